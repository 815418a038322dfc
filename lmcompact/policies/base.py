"""What a compaction policy is: its budget, what it needs, when it applies, what it returns.

A policy looks at one sequence and returns a :class:`~lmcompact.plan.KeepPlan`. It
never touches a cache or an engine object. Inputs are *candidates*
(:mod:`lmcompact.policies.inputs`); the plan's indices are candidate indices. The
budget is :class:`~lmcompact.policies.budget.Budget`; per-head top-k selection is
:func:`~lmcompact.policies._select.topk_mask` (the one implementation).

The names of those modules are re-exported here (``from lmcompact.policies.base
import CompactionInputs, Need, ...`` keeps working).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lmcompact.plan import KeepPlan
from lmcompact.policies._select import descending_order, rows_of, topk_keep, topk_mask
from lmcompact.policies.budget import Budget
from lmcompact.policies.inputs import (
    CompactionInputs,
    LayerObservation,
    Need,
    Phase,
    check_layer_tensor,
    check_structure,
    check_window_queries,
    need_names,
)

__all__ = [
    "Budget",
    "CompactionInputs",
    "CompactionPolicy",
    "LayerObservation",
    "Need",
    "Phase",
    "ScorePolicy",
    "check_structure",
    "descending_order",
    "need_names",
    "plan_from_scores",
    "topk_keep",
    "topk_mask",
]


@dataclass
class CompactionPolicy(ABC):
    """Base of every policy: a dataclass whose fields are the paper's hyper-parameters.

    Subclasses set ``name``, ``needs`` and ``phases`` and implement :meth:`plan`.
    """

    name: ClassVar[str]
    needs: ClassVar[Need] = Need.NOTHING
    phases: ClassVar[Phase] = Phase.PREFILL

    budget: Budget = field(default_factory=lambda: Budget(ratio=0.5))

    def __post_init__(self) -> None:
        self.budget = Budget.parse(self.budget)

    @abstractmethod
    def plan(self, inputs: CompactionInputs) -> KeepPlan:
        """Return the candidates to keep per (layer, kv_head)."""

    # ------------------------------------------------------------- helpers
    def keep_count(self, inputs: CompactionInputs, available: int | None = None) -> int:
        """Tokens to keep per head: the override, else the budget resolved on T.

        A ratio budget is resolved on ``available`` (default T, the padded
        candidate count); heads with fewer valid candidates keep all of them.
        ``inputs.budget_tokens`` (decode-time callers) is clipped to the length.
        """
        length = inputs.num_candidates if available is None else available
        if inputs.budget_tokens is not None:
            if inputs.budget_tokens <= 0:
                raise ValueError(f"budget_tokens override must be > 0, got {inputs.budget_tokens}")
            return min(inputs.budget_tokens, length)
        return self.budget.resolve(length)

    def context_queries(self, length: int) -> torch.Tensor | None:
        """``(S,)`` sorted positions of the prompt queries whose attention makes
        ``context_scores`` for a prompt of ``length`` tokens; None when the policy does
        not read them (every integration asks the policy, so all score alike)."""
        return None

    @property
    def scores_given(self) -> bool:
        """True when the policy reads ``context_scores`` that no attention pass computes
        (it samples no ``context_queries``): the integration must supply them with the
        request (``self_info``: surprisal from the engine's prompt logprobs)."""
        return Need.CONTEXT_SCORES in self.needs and self.context_queries(1) is None

    def context_shift(self, length: int) -> int | None:
        """Positions by which the integration moves the ``context_queries`` (RoPE) before
        scoring, letting each see every key (a repeat of the context after it); None
        scores them where they are, causally. Without RoPE facts integrations score
        causally."""
        return None

    def check_inputs(self, inputs: CompactionInputs) -> None:
        """Validate ``inputs`` against what this policy needs; ValueError says what is wrong.

        Checks that there is at least one layer and one candidate, that every
        input this policy declares in ``needs`` is present, and that every tensor
        that is present agrees with ``(num_kv_heads, num_candidates)`` (keys and
        scores of one layer must describe the same heads and candidates).
        """
        check_structure(self.name, inputs)
        needs = self.needs
        wanted = [
            (Need.KEYS, "keys"),
            (Need.WINDOW_SCORES, "window_scores"),
            (Need.WINDOW_ATTENTION, "window_attention"),
            (Need.CUMULATIVE_SCORES, "cumulative_scores"),
            (Need.CONTEXT_SCORES, "context_scores"),
            (Need.WINDOW_QUERIES, "window_queries"),
        ]
        for flag, attribute in wanted:
            if flag in needs:
                self.require(inputs, attribute)
        if Need.TOKEN_CLASSES in needs:
            for attribute in ("special_mask", "punctuation_mask"):
                if getattr(inputs, attribute) is None:
                    raise ValueError(
                        f"policy {self.name!r} needs {attribute} (a ({inputs.num_candidates},) "
                        "bool tensor over candidates) but it is None"
                    )

    def require(self, inputs: CompactionInputs, attribute: str) -> list[torch.Tensor]:
        """Per-layer tensors of ``attribute``, validated to be present and ``(H, T, ...)``."""
        tensors: list[torch.Tensor] = []
        for index, layer in enumerate(inputs.layers):
            value = getattr(layer, attribute)
            if value is None:
                raise ValueError(
                    f"policy {self.name!r} needs {attribute} but layer {index} has none; "
                    f"this policy reads: {', '.join(need_names(self.needs)) or 'nothing'}"
                )
            if attribute == "window_queries":
                check_window_queries(self.name, inputs, index, layer)
            else:
                check_layer_tensor(self.name, inputs, index, attribute, value)
            tensors.append(value)
        return tensors

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Name, hyper-parameters with defaults, needs and phases (for the CLI)."""
        params: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default: Any = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = None
            params[f.name] = str(default) if isinstance(default, Budget) else default
        needs = need_names(cls.needs)
        phases = [p.name for p in (Phase.PREFILL, Phase.DECODE) if p in cls.phases]
        doc = (cls.__doc__ or "").strip().splitlines()
        return {
            "name": cls.name,
            "summary": doc[0] if doc else "",
            "params": params,
            "needs": needs,
            "phases": phases,
        }

    def params(self) -> dict[str, Any]:
        """This instance's hyper-parameters as plain data (stable order)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = str(value) if isinstance(value, Budget) else value
        return out


def plan_from_scores(
    policy: CompactionPolicy,
    inputs: CompactionInputs,
    per_layer_scores: list[torch.Tensor],
    keep_per_layer: list[int | torch.Tensor] | None = None,
) -> KeepPlan:
    """Top-k per (layer, head) over ``per_layer_scores`` (each ``(H, T)``).

    ``keep_per_layer[l]`` is one count for every head of layer ``l`` or an
    ``(H,)`` tensor of per-head counts; default: ``policy.keep_count(inputs)``.
    Every layer is selected in one batched sort (no loop over layers or heads).
    """
    num_layers = len(per_layer_scores)
    heads, length = inputs.num_kv_heads, inputs.num_candidates
    device = per_layer_scores[0].device
    scores = torch.stack([s.detach().to(device, torch.float64) for s in per_layer_scores])
    if keep_per_layer is None:
        counts = torch.full((num_layers * heads,), policy.keep_count(inputs), dtype=torch.int64)
    else:
        counts = torch.stack(
            [torch.as_tensor(k, dtype=torch.int64).expand(heads) for k in keep_per_layer]
        ).flatten()
    valid = None
    if inputs.valid is not None:
        valid = inputs.valid.to(device).expand(num_layers, heads, length).reshape(-1, length)
    rows = rows_of(topk_mask(scores.view(num_layers * heads, length), counts, valid))
    kept = tuple(tuple(rows[layer * heads : (layer + 1) * heads]) for layer in range(num_layers))
    return KeepPlan(seq_len=length, kept=kept)


@dataclass
class ScorePolicy(CompactionPolicy):
    """A policy that scores candidates per (layer, head) and keeps the top ``budget``.

    Subclasses implement :meth:`score`; selection, validity masking and budget
    resolution live here so a method is a few lines (StreamingLLM, KNorm, ...).
    """

    span_scores: ClassVar[bool] = False
    """True when a key's score depends on the other keys scored with it (a softmax over
    them): an integration that plans a prompt in chunks (the vLLM save path) scores the
    whole span once (:meth:`score_all`) and plans each chunk from its slice
    (:meth:`plan_scored`)."""

    @abstractmethod
    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        """``(H, T)`` float scores for ``layer``; +inf forces a keep."""

    def plan(self, inputs: CompactionInputs) -> KeepPlan:
        self.check_inputs(inputs)
        return self.plan_scored(inputs, self.score_all(inputs))

    def plan_scored(self, inputs: CompactionInputs, scores: list[torch.Tensor]) -> KeepPlan:
        """The plan from per-layer ``(H, T)`` ``scores`` of ``inputs`` (:meth:`score_all`'s,
        or a slice of a longer span's); top-k per (layer, head) by default."""
        return plan_from_scores(self, inputs, scores)

    def score_all(self, inputs: CompactionInputs) -> list[torch.Tensor]:
        """Scores of every layer, each checked to be ``(H, T)``."""
        scores = [self.score(inputs, layer) for layer in range(inputs.num_layers)]
        for index, s in enumerate(scores):
            if tuple(s.shape) != (inputs.num_kv_heads, inputs.num_candidates):
                raise ValueError(
                    f"policy {self.name!r} scored layer {index} with shape {tuple(s.shape)}, "
                    f"expected ({inputs.num_kv_heads}, {inputs.num_candidates})"
                )
        return scores
