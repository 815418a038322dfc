"""KNorm: keep the keys with the lowest L2 norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy


@dataclass
class KNorm(ScorePolicy):
    """Keep the ``budget`` keys with the smallest L2 norm per (layer, head).

    Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression", https://arxiv.org/abs/2406.11430. The paper observes that a
    low key norm goes with high attention, so no attention scores are needed.

    Shapes: keys ``(H, T, head_dim)`` -> scores ``(H, T)`` = ``-||k||_2``.
    The method has no hyper-parameter besides the budget.
    """

    name = "knorm"
    needs = Need.KEYS
    phases = Phase.BOTH

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        keys = inputs.layers[layer].keys
        assert keys is not None  # check_inputs ran
        return -torch.linalg.vector_norm(keys.float(), dim=-1)
