"""H2O: heavy hitters by accumulated attention plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies._select import recent_mask
from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy


@dataclass
class H2O(ScorePolicy):
    """Heavy-Hitter Oracle: keep the most attended tokens and the most recent ones.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
    of Large Language Models", https://arxiv.org/abs/2306.14048. Of a budget of
    ``k`` tokens per (layer, head), ``round(recent_ratio * k)`` go to the most
    recent valid candidates and the rest to the candidates with the highest
    accumulated attention (the paper splits the budget evenly, hence 0.5).

    Shapes: cumulative_scores ``(H, T)`` (attention mass summed over every query
    so far, GQA-averaged) -> scores ``(H, T)``; the recent window scores +inf.

    Attributes:
        recent_ratio: Fraction of the budget for the recent window, in [0, 1].
    """

    name = "h2o"
    needs = Need.CUMULATIVE_SCORES
    phases = Phase.BOTH

    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")

    def recent_counts(self, inputs: CompactionInputs) -> torch.Tensor:
        """``(H,)`` recent-window size per head: ``round(recent_ratio * kept)``."""
        kept = inputs.valid_counts().clamp(max=self.keep_count(inputs))
        return torch.round(self.recent_ratio * kept.double()).to(torch.int64)

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        cumulative = inputs.layers[layer].cumulative_scores
        assert cumulative is not None  # check_inputs ran
        recent = recent_mask(inputs, self.recent_counts(inputs))
        return cumulative.detach().float().cpu().masked_fill(recent, float("inf"))
