"""SnapKV: rank prompt tokens by the attention of an observation window, pooled."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies._select import POOLINGS, pool_scores
from lmcompact.policies.base import CompactionInputs, Need, Phase
from lmcompact.policies.window_scored import WindowScoredPolicy


@dataclass
class SnapKV(WindowScoredPolicy):
    """Keep the observation window plus the prefix tokens the window attends to most.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
    https://arxiv.org/abs/2404.14469. The last ``window_size`` prompt tokens
    (the observation window) are always kept; the other candidates are ranked
    by the attention mass they receive from the window's queries, smoothed
    along the sequence by a 1-D pooling of width ``kernel_size`` so that the
    neighbours of an important token come along (the paper clusters this way).

    Shapes: window_scores ``(H, T)`` (mass summed over the window queries,
    GQA-averaged; computed with ``W = window_size``) -> scores ``(H, T)``; the
    window scores +inf. When the budget is at most ``window_size``, only the
    most recent ``budget`` tokens are kept.

    Attributes:
        window_size: Observation window length (paper: 32).
        kernel_size: Pooling width, odd (paper: 7).
        pooling: ``"maxpool"`` (paper default) or ``"avgpool"``.
    """

    name = "snapkv"
    needs = Need.WINDOW_SCORES
    phases = Phase.PREFILL

    kernel_size: int = 7
    pooling: str = "maxpool"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {self.kernel_size}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        prefix, window = self.window_mass(inputs, layer)
        pooled = pool_scores(prefix, self.kernel_size, self.pooling)
        # pooling makes a peak's neighbours tie with it; the raw mass breaks such ties
        tie_break = prefix / prefix.abs().max().clamp(min=1e-30) * 1e-9
        return (pooled + tie_break).masked_fill(window, float("inf"))
