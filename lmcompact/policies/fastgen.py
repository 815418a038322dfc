"""FastGen: each head keeps the cheapest token profile that recovers its attention."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmcompact.plan import KeepPlan
from lmcompact.policies._select import recent_mask, topk_mask
from lmcompact.policies.base import Budget, CompactionInputs, CompactionPolicy, Need, Phase

PROFILES = (
    "special",
    "special+punct",
    "special+punct+frequency",
    "special+punct+frequency+local",
    "full",
)
"""The paper's hybrid profiles, cheapest first; each contains the one before it."""


@dataclass
class FastGen(CompactionPolicy):
    """Adaptive KV cache: a per-head profile chosen by attention recovery.

    Ge et al., "Model Tells You What to Discard: Adaptive KV Cache Compression
    for LLMs", https://arxiv.org/abs/2310.01801. Each (layer, head) is profiled
    on the prompt's window attention and keeps the first profile of
    :data:`PROFILES` (special tokens; + punctuation; + frequent tokens; +
    local window; everything) whose *attention recovery* reaches
    ``recovery_threshold``. The profiles are nested, so the first one that
    qualifies is also the cheapest.

    - special: ``special_mask`` (BOS, instruction tokens, ...);
    - punct: ``punctuation_mask``;
    - frequency: the ``ceil(frequency_ratio * n)`` candidates with the most
      attention accumulated over the window queries (``n`` valid candidates);
    - local: the ``ceil(local_ratio * n)`` most recent candidates.

    Recovery of a set ``C`` for a head: the attention mass each window query puts
    on ``C`` (relative to its mass on all valid candidates), averaged over the
    window queries. The paper phrases the criterion as the compressed map being
    within ``1 - T`` of the full one; the kept mass is the quantity that error
    is driven by.

    Budget: FastGen's compression is adaptive (set by ``recovery_threshold``),
    so the budget is only a per-head *cap* and defaults to 1.0 (no cap, as in
    the paper). A head whose chosen profile is larger than the cap keeps the
    cap's worth of it: special tokens first, then by accumulated attention.
    Per-head counts differ; every head keeps at most ``k`` tokens.

    Shapes: window_attention ``(H, W, T)``; special_mask and punctuation_mask
    ``(T,)`` bool (shared by all heads).

    Attributes:
        recovery_threshold: ``T`` of the paper, in (0, 1].
        local_ratio: ``r_l``, fraction of the candidates in the local window.
        frequency_ratio: ``r_f``, fraction kept as frequent tokens.
    """

    name = "fastgen"
    needs = Need.WINDOW_ATTENTION | Need.TOKEN_CLASSES
    phases = Phase.PREFILL

    budget: Budget = field(default_factory=lambda: Budget(ratio=1.0))
    recovery_threshold: float = 0.95
    local_ratio: float = 0.3
    frequency_ratio: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.recovery_threshold <= 1.0:
            raise ValueError(f"recovery_threshold must be in (0, 1], got {self.recovery_threshold}")
        for label, value in (
            ("local_ratio", self.local_ratio),
            ("frequency_ratio", self.frequency_ratio),
        ):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{label} must be in [0, 1], got {value}")

    def profile_masks(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        """``(P, H, T)`` bool: the candidates of each profile of :data:`PROFILES`."""
        attention = inputs.layers[layer].window_attention
        assert attention is not None and inputs.special_mask is not None
        assert inputs.punctuation_mask is not None
        valid = inputs.valid_or_all().cpu()
        counts = valid.sum(dim=-1).double()
        accumulated = attention.detach().double().cpu().sum(dim=1)
        special = inputs.special_mask.cpu().expand_as(valid) & valid
        punct = special | (inputs.punctuation_mask.cpu().expand_as(valid) & valid)
        frequent = punct | topk_mask(accumulated, _ceil(self.frequency_ratio * counts), valid)
        local = frequent | recent_mask(inputs, _ceil(self.local_ratio * counts))
        return torch.stack([special, punct, frequent, local, valid])

    @staticmethod
    def recovery(attention: torch.Tensor, masks: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``(P, H)`` mean over window queries of the attention mass kept by each profile.

        Args:
            attention: ``(H, W, T)`` window attention rows.
            masks: ``(P, H, T)`` profile masks.
            valid: ``(H, T)`` valid candidates.
        """
        rows = attention.detach().double().cpu() * valid.unsqueeze(1)
        total = rows.sum(dim=-1)  # (H, W)
        kept = torch.einsum("hwt,pht->phw", rows, masks.double())
        seen = total > 0
        ratio = torch.where(seen, kept / total.clamp(min=1e-30), torch.ones_like(kept))
        return ratio.sum(dim=-1) / seen.sum(dim=-1).clamp(min=1)

    def choose_profiles(self, inputs: CompactionInputs) -> list[list[str]]:
        """The profile name of every (layer, head)."""
        self.check_inputs(inputs)
        return [
            [PROFILES[int(i)] for i in self._choice(inputs, layer)[0]]
            for layer in range(inputs.num_layers)
        ]

    def _choice(self, inputs: CompactionInputs, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        masks = self.profile_masks(inputs, layer)
        attention = inputs.layers[layer].window_attention
        assert attention is not None
        recovered = self.recovery(attention, masks, inputs.valid_or_all().cpu())
        meets = recovered >= self.recovery_threshold - 1e-9
        meets[-1] = True  # full always qualifies
        choice = meets.to(torch.int8).argmax(dim=0)  # first qualifying profile per head
        return choice, masks

    def plan(self, inputs: CompactionInputs) -> KeepPlan:
        self.check_inputs(inputs)
        cap = self.keep_count(inputs)
        layers = []
        for layer in range(inputs.num_layers):
            choice, masks = self._choice(inputs, layer)
            chosen = masks[choice, torch.arange(inputs.num_kv_heads)]  # (H, T)
            attention = inputs.layers[layer].window_attention
            assert attention is not None and inputs.special_mask is not None
            rank = attention.detach().double().cpu().sum(dim=1)
            rank = rank.masked_fill(inputs.special_mask.cpu().expand_as(rank), float("inf"))
            capped = topk_mask(rank, cap, chosen)
            layers.append(tuple(torch.nonzero(row).flatten() for row in capped))
        return KeepPlan(seq_len=inputs.num_candidates, kept=tuple(layers))


def _ceil(values: torch.Tensor) -> torch.Tensor:
    return torch.ceil(values - 1e-9).to(torch.int64).clamp(min=0)
