"""``keep_first_demo``: keeps the earliest candidates (a plugin test fixture, not a method)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies import CompactionInputs, Need, Phase, ScorePolicy


@dataclass
class KeepFirst(ScorePolicy):
    """Keep the ``budget`` earliest candidates of every (layer, head)."""

    name = "keep_first_demo"
    needs = Need.NOTHING
    phases = Phase.BOTH

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        return -inputs.positions_or_arange().to(torch.float64)


class NotAPolicy:
    """An entry point that points at something else (for the error path)."""

    name = "not_a_policy_demo"
