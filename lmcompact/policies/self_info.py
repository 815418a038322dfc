"""Self-information: keep the spans of a context that the model found hardest to predict."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmcompact.policies._select import pool_scores
from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy


def surprisal_from_logprobs(logprobs: list[float | None]) -> list[float]:
    """``-log p(token_i | tokens_<i)`` per prompt token from an engine's prompt logprobs
    (vLLM's ``prompt_logprobs`` give None for the first token, which gets 0)."""
    return [0.0 if lp is None else -float(lp) for lp in logprobs]


@dataclass
class SelfInformation(ScorePolicy):
    """Keep the context's most surprising spans, one token set for every (layer, head).

    Query-agnostic scoring by self-information, after Selective Context (Li et al.,
    "Compressing Context to Enhance Inference Efficiency of Large Language Models",
    EMNLP 2023, https://arxiv.org/abs/2310.06201) and LLMLingua (Jiang et al., 2023,
    https://arxiv.org/abs/2310.05736), which drop prompt tokens the model predicts
    well. Here the KV of the context is compacted instead of its text: each token's
    score is its surprisal ``-log p(token | prefix)`` from one prefill of the context
    (the integration supplies it as ``context_scores``, the same ``(T,)`` for every
    layer and head: vLLM's ``prompt_logprobs``, ``connectors/vllm/reconstruct.py``
    :func:`~connectors.vllm.reconstruct.store_surprisal_context`; transformers,
    :func:`lmcompact.hf.reconstruct.surprisal`). Names, numbers and other facts are
    improbable tokens; boilerplate is not. The first ``warmup`` positions' surprisal is
    scaled by ``position / warmup`` (see below). A fact is a span, so the scores are then
    averaged over ``smooth`` tokens (a dense stretch of surprising tokens beats one odd
    token), optionally minus their local background (the mean over the ``background``
    nearest tokens), and max-pooled over ``kernel_size`` (a kept span keeps its
    neighbours whole); the first ``n_sink`` positions are always kept.

    Why the warm-up: the first tokens of a document are improbable because the model has
    nothing to predict them from yet, not because they say something new. Ranked raw,
    they fill the first chunk's budget and a fact in that chunk is lost. The background
    treats every uniformly surprising stretch (code, tables) alike by ranking a span by how
    much it stands out from its surroundings; it is off by default, the warm-up on (what
    each lost and kept: ``docs/eval/RESULTS.md``, "Defaults from more cells").

    Every (layer, head) gets the same scores, so all keep the same tokens: a number keeps
    all of its digits in every head.

    Cost: the scores need a prefill of the context with the LM head on every context
    position (one request with ``prompt_logprobs``); scoring is ``O(T)``.

    Shapes: context_scores ``(H, T)`` -> scores ``(H, T)``, sinks +inf.

    Attributes:
        n_sink: Initial positions always kept (attention sinks).
        smooth: Average-pool width over the surprisal, odd (1: none).
        kernel_size: Max-pool width after smoothing, odd (1: none).
        background: Width of the moving mean subtracted after smoothing, odd (1: none;
            the mean counts only tokens inside the candidates, so a chunk's edges are
            not diluted by padding).
        warmup: Positions (absolute, from the context's start) over which the surprisal
            ramps up from 0 (0: none; default 64, a quarter of a 256-token store chunk).
    """

    name = "self_info"
    needs = Need.CONTEXT_SCORES
    phases = Phase.PREFILL

    n_sink: int = 4
    smooth: int = 7
    kernel_size: int = 31
    background: int = 1
    warmup: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("n_sink", "warmup"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
        for key in ("smooth", "kernel_size", "background"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1 or value % 2 == 0:
                raise ValueError(f"{key} must be an odd integer >= 1, got {value!r}")

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        scores = inputs.layers[layer].context_scores
        assert scores is not None  # check_inputs ran
        raw = scores.detach().double().masked_fill(~inputs.valid_or_all().to(scores.device), 0.0)
        positions = inputs.positions_or_arange().to(scores.device)
        if self.warmup:
            raw = raw * (positions.double() / self.warmup).clamp(max=1.0)
        dense = pool_scores(raw, self.smooth, "avgpool")
        dense = dense - local_mean(dense, self.background)
        pooled = pool_scores(dense, self.kernel_size, "maxpool")
        sinks = positions < self.n_sink
        # pooling makes a peak's neighbours tie with it; the smoothed score breaks ties
        return (pooled + dense * 1e-6).masked_fill(sinks, float("inf"))


def local_mean(scores: torch.Tensor, width: int) -> torch.Tensor:
    """``(H, T)`` mean of ``scores`` over the ``width`` nearest positions (centred; near
    the ends over those that exist); zeros when ``width`` is 1 (no background)."""
    if width == 1:
        return torch.zeros_like(scores)
    pad = width // 2
    return F.avg_pool1d(scores[:, None], width, stride=1, padding=pad, count_include_pad=False)[
        :, 0
    ]
