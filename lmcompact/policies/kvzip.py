"""KVzip-style query-agnostic scores: the most attention each key gets from prompt queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.plan import KeepPlan
from lmcompact.policies._select import pool_scores
from lmcompact.policies.allocation import global_keep_plan, ragged_keep_mask
from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy

ALLOCATIONS = ("head", "global", "ragged")

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"
"""What a reconstruction pass puts between the two copies of the context (KVzip's
instruction, plain text: the base models here have no chat template)."""


def reconstruction_ids(context_ids: list[int], repeat_ids: list[int]) -> list[int]:
    """Token ids of KVzip's reconstruction pass: ``context + repeat + context``."""
    if not context_ids:
        raise ValueError("the context to reconstruct is empty")
    return list(context_ids) + list(repeat_ids) + list(context_ids)


def shared_scores(inputs: CompactionInputs) -> torch.Tensor:
    """``(1, T)`` mean context score over every layer and head that has one."""
    maps = [o.context_scores for o in inputs.layers if o.context_scores is not None]
    if not maps:
        raise ValueError("shared kvzip scores need context_scores on at least one layer")
    return torch.stack([m.double() for m in maps]).mean(dim=(0, 1)).unsqueeze(0)


def sample_query_positions(length: int, max_queries: int, window: int) -> torch.Tensor:
    """``(S,)`` sorted prompt positions whose queries score the keys.

    Every position when ``length <= max_queries``; otherwise the last ``window``
    positions and ``max_queries - window`` evenly spaced ones before them (each ends
    its stretch of the prompt), so ``S = max_queries``.
    """
    if length <= 0:
        raise ValueError(f"length must be > 0, got {length}")
    if length <= max_queries:
        return torch.arange(length)
    tail = min(window, max_queries)
    head_len = length - tail
    room = max_queries - tail
    head = (torch.arange(1, room + 1) * head_len) // room - 1
    return torch.cat([head, torch.arange(head_len, length)])


@dataclass
class KVzip(ScorePolicy):
    """Keep the keys that some prompt query attends to most (query-agnostic).

    In the spirit of Kim et al., "KVzip: Query-Agnostic KV Cache Compression with
    Context Reconstruction", https://arxiv.org/abs/2505.23416. KVzip runs a second
    forward pass, "Repeat the previous context:" followed by the context, and scores
    each key by the largest softmax attention weight any reconstruction query (and
    any query head of its GQA group) gives it; keys the model needs to reproduce the
    context are kept, whatever the future question is.

    Two sources of context scores. (1) The real second pass: a request marked as a
    reconstruction pass (``connectors/vllm/reconstruct.py``: ``store_context`` sends
    ``context + REPEAT_PROMPT + context``; :mod:`lmcompact.hf.reconstruct` in
    transformers) scores the first copy's keys with the repeat's queries
    (:func:`lmcompact.attention.scores.reconstruction_scores`) and only the first copy
    is stored. (2) Any other request (single pass, the fallback): the queries are the
    prompt's own prefill queries, sampled across the whole prompt
    (:meth:`context_queries`: all of them up to ``max_queries``, else the last ``window``
    and evenly spaced ones before them), captured where the engine computes them.
    With ``repeat`` (default) each sampled query is moved by RoPE to position
    ``T + p`` (:meth:`context_shift`), where its token would sit in a repeat of the
    context, and sees every key, softmax-normalized over all of them: an induction head
    then reads the key *after* the query's own token, as in a reconstruction, and every
    query has the same number of keys (no bias towards early keys). Without RoPE facts,
    or with ``repeat=False``, queries score causally (keys at or before their position,
    normalized over those, as the prefill did). Aggregation is KVzip's: the max over
    queries and over the GQA group (a sum would favour keys more queries see). Then a
    max-pool of width ``kernel_size`` along the sequence (as SnapKV does; a number is
    several tokens, and a digit that scores low next to one that scores high comes
    along), and the first ``n_sink`` positions are always kept.

    Cost: single pass, ``S x T`` query-key products per layer and query head on top of
    the prefill (README: measured on SmolLM2 at 2k / 4k on the CPU); reconstruction, a
    second prefill of the context plus ``T x 2T`` products per query head and layer.
    Allocation: KVzip ranks all layers and heads together (a global top-k; heads keep
    ragged counts). The store needs one count per (layer, head) (and per chunk), so
    ``allocation="head"`` keeps each head's own top-k, and ``allocation="global"`` runs
    the global top-k over every (layer, head, token) of the candidates and projects it
    onto the uniform count (:func:`lmcompact.policies.allocation.global_keep_mask`): a
    head keeps its own best tokens when the global choice gave it at least its count,
    else what it was given plus the tokens most other heads were given. With ``share``
    every head keeps the tokens most heads were given. Same total kept, same memory.
    ``allocation="ragged"`` is KVzip's own choice (kvpress's ``KVzipPress``): the global
    top-k with ragged counts, each (layer, head) capped at ``inputs.max_tokens`` and each
    layer at ``inputs.max_layer_tokens`` (the vLLM store's ``store.per_head`` caps; without
    them every head keeps its count, as ``"head"``).

    Shapes: context_scores ``(H, T)`` in ``[0, 1]`` -> scores ``(H, T)``, sinks +inf.

    Attributes:
        n_sink: Initial positions always kept (attention sinks).
        window: Last prompt queries always sampled.
        max_queries: Most prompt queries sampled (>= ``window``).
        repeat: Score the queries as a repeat of the context after it (needs RoPE
            facts from the integration; else causal).
        kernel_size: Max-pool width along the sequence, odd (1: none).
        share: One token set for every (layer, head): the context scores are averaged
            over all layers and heads before pooling, so a kept token is kept everywhere
            (a number keeps all its digits in every head, where per-head choices drop
            one digit here and another there). With a wide ``kernel_size`` (15) whole
            facts survive together. With ``allocation="global"``, the shared set is
            ranked by the global top-k's votes instead of the mean score.
        allocation: ``"head"`` (each head its own top-k), ``"global"`` or ``"ragged"``
            (see above).
    """

    name = "kvzip"
    needs = Need.CONTEXT_SCORES
    phases = Phase.PREFILL

    n_sink: int = 4
    window: int = 32
    max_queries: int = 1024
    repeat: bool = True
    kernel_size: int = 3
    share: bool = False
    allocation: str = "head"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {self.kernel_size}")
        if self.max_queries < max(1, self.window):
            raise ValueError(
                f"max_queries must be >= max(1, window={self.window}), got {self.max_queries}"
            )
        if self.allocation not in ALLOCATIONS:
            raise ValueError(
                f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}"
            )
        if self.share and self.allocation == "ragged":
            raise ValueError(
                "share keeps one token set for every head; allocation 'ragged' "
                "gives each head its own count: choose one"
            )

    def context_queries(self, length: int) -> torch.Tensor:
        return sample_query_positions(length, self.max_queries, self.window)

    def context_shift(self, length: int) -> int | None:
        return length if self.repeat else None

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        scores = inputs.layers[layer].context_scores
        assert scores is not None  # check_inputs ran
        if self.share and self.allocation == "head":
            scores = shared_scores(inputs).expand_as(scores)
        sinks = (inputs.positions_or_arange() < self.n_sink).to(scores.device)
        raw = scores.detach().double().masked_fill(~inputs.valid_or_all().to(scores.device), 0.0)
        pooled = pool_scores(raw, self.kernel_size, "maxpool")
        # pooling makes a peak's neighbours tie with it; the raw score breaks such ties
        return (pooled + raw * 1e-6).masked_fill(sinks, float("inf"))

    def plan_scored(self, inputs: CompactionInputs, scores: list[torch.Tensor]) -> KeepPlan:
        if self.allocation == "head":
            return super().plan_scored(inputs, scores)
        if self.allocation == "ragged":
            keep = self.keep_count(inputs)
            cap = max(keep, min(inputs.max_tokens or keep, inputs.num_candidates))
            stacked = torch.stack([s.detach() for s in scores])
            layer_cap = inputs.max_layer_tokens
            if layer_cap is not None:
                layer_cap = max(layer_cap, keep * inputs.num_kv_heads)
            return KeepPlan.from_masks(
                ragged_keep_mask(stacked, keep, cap, inputs.valid, layer_cap)
            )
        return global_keep_plan(scores, self.keep_count(inputs), inputs.valid, self.share)
