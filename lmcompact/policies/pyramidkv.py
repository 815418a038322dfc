"""PyramidKV: SnapKV scoring with per-layer budgets shaped like a pyramid."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.plan import KeepPlan
from lmcompact.policies._select import split_evenly
from lmcompact.policies.base import CompactionInputs, Need, Phase, plan_from_scores
from lmcompact.policies.snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """SnapKV with more tokens in lower layers and fewer in higher ones.

    Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling", https://arxiv.org/abs/2406.02069. Tokens are ranked
    exactly as in :class:`~lmcompact.policies.snapkv.SnapKV`. The budget ``k``
    is the *mean* per-layer budget; besides the observation window ``w`` each
    layer ``l`` of ``L`` gets an arithmetic share of ``m = k - w``::

        top    = m / beta
        bottom = 2 * m - top
        b_l    = bottom - l * (bottom - top) / (L - 1)      (l = 0 .. L-1)

    so ``mean(b_l) = m`` and layer 0 keeps the most. Shares are rounded so they
    sum to ``L * m`` exactly; a layer whose share exceeds its candidates is
    capped and the excess goes to the other layers. Every head of a layer keeps
    the same count, so the total over layers is ``L * k`` (or less when the
    prompt is too short to absorb it).

    Shapes: window_scores ``(H, T)`` per layer, as for SnapKV.

    Attributes:
        beta: Ratio of the bottom share to the top one's deficit (paper: 20).
    """

    name = "pyramidkv"
    needs = Need.WINDOW_SCORES
    phases = Phase.PREFILL

    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta >= 1.0:
            raise ValueError(f"beta must be >= 1 (1 means equal budgets), got {self.beta}")

    def layer_budgets(self, inputs: CompactionInputs) -> list[int]:
        """Tokens each layer keeps per head (window included), in layer order."""
        available = int(inputs.valid_counts().min())
        return self.budgets_for(self.keep_count(inputs), available, inputs.num_layers)

    def budgets_for(self, keep: int, available: int, layers: int) -> list[int]:
        """:meth:`layer_budgets` from a mean of ``keep`` per head, ``available`` valid
        candidates in every head and ``layers`` layers (no inputs needed: a device pack
        sizes its cells from these counts before it selects)."""
        window = min(self.window_size, keep, available)
        mean_share = keep - window
        if layers == 1:
            targets = [float(mean_share)]
        else:
            top = mean_share / self.beta
            bottom = 2 * mean_share - top
            step = (bottom - top) / (layers - 1)
            targets = [bottom - layer * step for layer in range(layers)]
        caps = [max(available - window, 0)] * layers
        shares = split_evenly(mean_share * layers, targets, caps)
        return [window + share for share in shares]

    def plan(self, inputs: CompactionInputs) -> KeepPlan:
        self.check_inputs(inputs)
        scores = self.score_all(inputs)
        budgets: list[int | torch.Tensor] = list(self.layer_budgets(inputs))
        return plan_from_scores(self, inputs, scores, keep_per_layer=budgets)
