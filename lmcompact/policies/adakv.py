"""Ada-KV: share a layer's budget across its heads by comparing scores between heads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcompact.plan import KeepPlan
from lmcompact.policies._select import topk_mask_here
from lmcompact.policies.base import (
    CompactionInputs,
    CompactionPolicy,
    Need,
    Phase,
    ScorePolicy,
    descending_order,
)


@dataclass
class AdaKV(CompactionPolicy):
    """Adaptive per-head budgets over any token scorer.

    Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation for Efficient LLM Inference", https://arxiv.org/abs/2407.11550.
    A layer with ``H`` heads and a per-head budget ``k`` keeps ``k * H``
    tokens in total. Each head first gets a safeguard of its own
    ``ceil(alpha_safeguard * k)`` best tokens; the rest of the layer's budget goes
    to the best remaining (head, token) pairs over the flattened ``(H x T)``
    scores, so heads with concentrated attention give budget to heads with
    spread-out attention. Scores come from any registered score-based policy
    (``scorer``), whose forced keeps (+inf, e.g. SnapKV's window) stay forced.

    Shapes: the scorer's ``(H, T)`` scores per layer. Per-head counts differ;
    the per-layer total is ``min(k * H, valid candidates of the layer)``. With
    ``inputs.max_tokens`` (a layout's per-head cap) no head keeps more than that: its
    pairs past its own best ``max_tokens`` leave the ranking, so the layer's budget goes
    to the other heads' next best (and ``max_layer_tokens`` bounds the layer).
    ``needs`` and ``phases`` of an instance are the scorer's.

    Attributes:
        scorer: Registered name of a score-based policy (snapkv, h2o, tova,
            knorm, streaming_llm, random, pyramidkv).
        scorer_params: Hyper-parameters of the scorer (its budget is this policy's).
        alpha_safeguard: Fraction of ``k`` guaranteed to every head (paper: 0.2).
    """

    name = "adakv"
    needs = Need.WINDOW_SCORES
    phases = Phase.PREFILL

    scorer: str = "snapkv"
    scorer_params: dict[str, Any] = field(default_factory=dict)
    alpha_safeguard: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {self.alpha_safeguard}")
        from lmcompact.policies.registry import get_policy_class  # avoid an import cycle

        cls = get_policy_class(self.scorer)
        if not issubclass(cls, ScorePolicy):
            raise ValueError(
                f"adakv needs a score-based scorer (a ScorePolicy such as snapkv, h2o, tova, "
                f"knorm, streaming_llm, random); {self.scorer!r} is not one"
            )
        params = {"budget": self.budget, **self.scorer_params}
        try:
            self.inner: ScorePolicy = cls(**params)
        except TypeError as error:
            raise ValueError(f"bad scorer_params for {self.scorer!r}: {error}") from None
        # An instance reads what its scorer reads (class attributes describe the default).
        self.__dict__["needs"] = cls.needs
        self.__dict__["phases"] = cls.phases

    def check_inputs(self, inputs: CompactionInputs) -> None:
        self.inner.check_inputs(inputs)

    def layer_mask(self, scores: torch.Tensor, inputs: CompactionInputs) -> torch.Tensor:
        """``(H, T)`` bool keep mask of one layer from its ``(H, T)`` scores, on their device."""
        return self.layer_masks(scores[None], inputs)[0]

    def layer_masks(self, scores: torch.Tensor, inputs: CompactionInputs) -> torch.Tensor:
        """``(L, H, T)`` bool keep masks from every layer's ``(L, H, T)`` scores at once."""
        layers, heads, length = scores.shape
        chosen = self.layer_choices(scores, inputs)
        mask = torch.zeros(layers, heads * length, dtype=torch.bool, device=scores.device)
        mask.scatter_(1, chosen, True)
        return mask.view(layers, heads, length)

    def layer_choices(self, scores: torch.Tensor, inputs: CompactionInputs) -> torch.Tensor:
        """``(L, N)`` kept pairs of every layer from its ``(L, H, T)`` scores: flat indices
        ``head * T + token``, best first. ``N`` (the same for every layer) is known on the
        host before anything is ranked.

        Ranked where the scores are, all layers in each sort (a GPU pack does not sort on
        the host, nor wait for the device once per layer); each layer's choice is the one
        its own ranking gives."""
        keep = self.keep_count(inputs)
        device = scores.device
        layers, heads, length = scores.shape
        valid_heads = inputs.valid_or_all()
        valid = valid_heads.to(device).expand(layers, heads, length).reshape(-1, length)
        ranked = scores.detach().double().reshape(layers * heads, length)
        if inputs.max_tokens is not None:
            # a head's pairs past its own best max_tokens never compete: the layer's budget
            # goes to the next best pairs of the other heads (a capped top-k, in one pass)
            cap = min(inputs.max_tokens, length)
            valid = valid & topk_mask_here(ranked, cap, valid)
        safeguard = topk_mask_here(ranked, math.ceil(self.alpha_safeguard * keep), valid)
        # every layer has the same valid pairs, so the same total
        total = self.layer_total(inputs)
        # One ranking per layer over its flattened (H x T) pairs: safeguards first, then by
        # score; invalid slots last (never reached, total <= valid slots).
        ranked = ranked.masked_fill(safeguard, float("inf")).reshape(layers, heads * length)
        return descending_order(ranked, valid.reshape(layers, heads * length))[:, :total]

    def layer_total(self, inputs: CompactionInputs) -> int:
        """Pairs every layer keeps: ``k x H``, at most the valid (capped) candidates and
        ``max_layer_tokens``."""
        available = inputs.valid_or_all().sum(dim=-1)
        if inputs.max_tokens is not None:
            available = available.clamp(max=min(inputs.max_tokens, inputs.num_candidates))
        total = min(self.keep_count(inputs) * inputs.num_kv_heads, int(available.sum()))
        if inputs.max_tokens is not None and inputs.max_layer_tokens is not None:
            total = min(total, inputs.max_layer_tokens)
        return total

    def plan(self, inputs: CompactionInputs) -> KeepPlan:
        self.check_inputs(inputs)
        scores = torch.stack(list(self.inner.score_all(inputs)))
        return KeepPlan.from_masks(self.layer_masks(scores, inputs))
