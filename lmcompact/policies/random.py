"""Random: a seeded uniform subset per (layer, head), the floor every method must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy


@dataclass
class RandomPolicy(ScorePolicy):
    """Keep a uniformly random subset of ``budget`` valid candidates per (layer, head).

    The baseline of every KV-compression paper's ablations (no paper of its
    own). Scores are i.i.d. uniform draws from a generator seeded with
    ``seed`` and the layer index, so one policy instance gives the same plan
    for the same inputs, and heads and layers draw independently.

    Shapes: scores ``(H, T)``; no inputs are read besides ``valid``.

    Attributes:
        seed: Seed of the random generator.
    """

    name = "random"
    needs = Need.NOTHING
    phases = Phase.BOTH

    seed: int = 0

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        return torch.rand(inputs.num_kv_heads, inputs.num_candidates, generator=generator)
