"""Keep every token: the baseline and the exactness check of every integration."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmcompact.plan import KeepPlan
from lmcompact.policies.base import Budget, CompactionInputs, CompactionPolicy, Need, Phase


@dataclass
class KeepAll(CompactionPolicy):
    """No compaction: every valid candidate of every (layer, head) is kept.

    The budget is fixed at 1.0 and ignored.
    """

    name = "none"
    needs = Need.NOTHING
    phases = Phase.BOTH

    budget: Budget = field(default_factory=lambda: Budget(ratio=1.0))

    def plan(self, inputs: CompactionInputs) -> KeepPlan:
        self.check_inputs(inputs)
        valid = inputs.valid_or_all()
        heads = tuple(torch.nonzero(v).flatten() for v in valid)
        return KeepPlan(seq_len=inputs.num_candidates, kept=tuple(heads for _ in inputs.layers))
