"""The base of policies ranked by an observation window's attention (SnapKV, ChunkKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies._select import recent_mask
from lmcompact.policies.base import CompactionInputs, Need, ScorePolicy


@dataclass
class WindowScoredPolicy(ScorePolicy):
    """Keeps the observation window (the prompt's last ``window_size`` tokens, whose
    queries score the others) and ranks the rest by the window's attention mass
    (``window_scores``); subclasses say how the mass becomes a ranking.

    Attributes:
        window_size: Observation window length (SnapKV's paper: 32).
    """

    needs = Need.WINDOW_SCORES

    window_size: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size < 0:
            raise ValueError(f"window_size must be >= 0, got {self.window_size}")

    def window_mask(self, inputs: CompactionInputs) -> torch.Tensor:
        """``(H, T)`` bool: the observation window (the most recent valid candidates, no
        more than the budget)."""
        kept = inputs.valid_counts().clamp(max=self.keep_count(inputs))
        return recent_mask(inputs, kept.clamp(max=self.window_size))

    def window_mass(
        self, inputs: CompactionInputs, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mass, window)``: ``layer``'s ``(H, T)`` window scores in float64, zero on the
        window and on invalid candidates, and :meth:`window_mask`, both where the scores are.

        Left on the scores' device, so a GPU pack ranks there instead of sorting every
        layer on the host (docs/benchmarks/perhead-h100.md)."""
        scores = inputs.layers[layer].window_scores
        assert scores is not None  # check_inputs ran
        device = scores.device
        window = self.window_mask(inputs).to(device)
        dropped = window | ~inputs.valid_or_all().to(device)
        return scores.detach().double().masked_fill(dropped, 0.0), window
