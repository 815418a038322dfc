"""TOVA: keep the tokens the last query attends to most, averaged over the layer's heads."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from lmcompact.policies.base import (
    CompactionInputs,
    LayerObservation,
    Need,
    Phase,
    ScorePolicy,
    check_structure,
)

logger = logging.getLogger(__name__)


@dataclass
class TOVA(ScorePolicy):
    """Token Omission Via Attention: rank by the last query's attention, head-averaged.

    Oren et al., "Transformers are Multi-State RNNs", https://arxiv.org/abs/2401.06104.
    The score of a candidate is the attention weight it gets from the most
    recent query, averaged over the heads of the layer, so every head of a
    layer keeps the same tokens (the paper found head-averaging better than
    per-head choices).

    Shapes: window_attention ``(H, W, T)``, of which the last row ``[:, -1, :]``
    is used; or, when ``window_attention`` is None, window_scores ``(H, T)``
    computed with a window of one query. Scores ``(H, T)``: the head mean,
    broadcast to every head.

    On padded decode candidates the mean is taken over the heads where a slot
    is valid. Averaging by slot presumes slot ``j`` holds the same token in
    every head (true at the end of prefill and whenever TOVA compacted the
    cache); if ``positions`` differ between heads, each head ranks by its own
    row instead.

    The method has no hyper-parameter besides the budget.
    """

    name = "tova"
    needs = Need.WINDOW_ATTENTION
    phases = Phase.BOTH
    #: Observation window a cache captures for TOVA: only the last query's row is read.
    window_size: ClassVar[int] = 1

    def check_inputs(self, inputs: CompactionInputs) -> None:
        check_structure(self.name, inputs)
        for index, layer in enumerate(inputs.layers):
            if layer.window_attention is None and layer.window_scores is None:
                raise ValueError(
                    f"policy 'tova' needs window_attention (kv_heads, W, T) (its last row is "
                    f"used) or window_scores (kv_heads, T) from a 1-query window, but layer "
                    f"{index} has neither"
                )

    @staticmethod
    def last_query_row(layer: LayerObservation) -> torch.Tensor:
        """``(H, T)`` attention of the most recent query."""
        if layer.window_attention is not None:
            return layer.window_attention[:, -1, :]
        assert layer.window_scores is not None
        return layer.window_scores

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        row = self.last_query_row(inputs.layers[layer]).detach().float().cpu()
        positions = inputs.positions
        if positions is not None and not bool((positions == positions[:1]).all()):
            logger.debug("tova: candidate positions differ across heads; scoring per head")
            return row
        valid = inputs.valid_or_all().cpu()
        summed = (row * valid).sum(dim=0)
        heads = valid.sum(dim=0).clamp(min=1)
        return (summed / heads).expand_as(row).clone()
