"""KVzip-style query-agnostic scores: the most attention each key gets from prompt queries."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy


def sample_query_positions(length: int, max_queries: int, window: int) -> torch.Tensor:
    """``(S,)`` sorted prompt positions whose queries score the keys.

    Every position when ``length <= max_queries``; otherwise the last ``window``
    positions and every ``stride``-th one before them (the ones that end a stride, so
    each sees the ``stride`` keys before it), ``S <= max_queries``.
    """
    if length <= 0:
        raise ValueError(f"length must be > 0, got {length}")
    if length <= max_queries:
        return torch.arange(length)
    tail = min(window, max_queries)
    head_len = length - tail
    room = max_queries - tail
    if room <= 0:
        return torch.arange(head_len, length)
    stride = math.ceil(head_len / room)
    head = torch.arange(stride - 1, head_len, stride)
    return torch.cat([head, torch.arange(head_len, length)])


@dataclass
class KVzip(ScorePolicy):
    """Keep the keys that some prompt query attends to most (query-agnostic).

    In the spirit of Kim et al., "KVzip: Query-Agnostic KV Cache Compression with
    Context Reconstruction", https://arxiv.org/abs/2505.23416. KVzip runs a second
    forward pass, "Repeat the previous context:" followed by the context, and scores
    each key by the largest softmax attention weight any reconstruction query (and
    any query head of its GQA group) gives it; keys the model needs to reproduce
    the context are kept, whatever the future question is.

    Here the scores come from the prompt's own prefill queries, sampled across the
    whole prompt (:meth:`context_queries`: all of them up to ``max_queries``, else
    every ``stride``-th plus the last ``window``), each seeing only keys at or before
    its position and normalized over them as in the model's attention; aggregation is
    the max over queries and over the GQA group, as in KVzip (a sum would favour early
    keys, which more queries see). The first ``n_sink`` positions are always kept.
    This needs no extra forward pass, so an engine can compute it from what its
    prefill already produced (the vLLM connector captures these queries), at the cost
    of ``S x T / 2`` extra query-key products per layer and head (measured in the
    README); differences from the paper: no copy queries (a prefill query looks back
    to read, not to reproduce), causal instead of full-context visibility, and a
    uniform count per (layer, head) instead of KVzip's head-adaptive global top-k.

    Shapes: context_scores ``(H, T)`` in ``[0, 1]`` -> scores ``(H, T)``, sinks +inf.

    Attributes:
        n_sink: Initial positions always kept (attention sinks).
        window: Last prompt queries always sampled.
        max_queries: Most prompt queries sampled (>= ``window``).
    """

    name = "kvzip"
    needs = Need.CONTEXT_SCORES
    phases = Phase.PREFILL

    n_sink: int = 4
    window: int = 32
    max_queries: int = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.max_queries < max(1, self.window):
            raise ValueError(
                f"max_queries must be >= max(1, window={self.window}), got {self.max_queries}"
            )

    def context_queries(self, length: int) -> torch.Tensor:
        return sample_query_positions(length, self.max_queries, self.window)

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        scores = inputs.layers[layer].context_scores
        assert scores is not None  # check_inputs ran
        sinks = (inputs.positions_or_arange() < self.n_sink).to(scores.device)
        return scores.detach().double().masked_fill(sinks, float("inf"))
