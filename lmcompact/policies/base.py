"""What a compaction policy is: its budget, what it needs, when it applies, what it returns.

A policy looks at one sequence and returns a :class:`~lmcompact.plan.KeepPlan`. It
never touches a cache or an engine object. Inputs are *candidates*: at the end of
prefill the candidates are the prompt's tokens (candidate ``i`` is position ``i``);
during decode they are the tokens a cache currently holds, padded to a common
length with ``valid`` marking real entries and ``positions`` giving their
original positions. The plan's indices are candidate indices.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lmcompact.plan import KeepPlan


class Need(enum.Flag):
    """Inputs a policy reads; the integration computes only what is asked for."""

    NOTHING = 0
    KEYS = enum.auto()
    """Post-RoPE keys ``(kv_heads, T, head_dim)``."""
    WINDOW_SCORES = enum.auto()
    """Observation-window attention mass per key ``(kv_heads, T)``."""
    WINDOW_ATTENTION = enum.auto()
    """Per-query window attention rows ``(kv_heads, W, T)`` (GQA-averaged)."""
    CUMULATIVE_SCORES = enum.auto()
    """Attention mass accumulated over all queries so far ``(kv_heads, T)``."""
    TOKEN_CLASSES = enum.auto()
    """Per-token special / punctuation masks ``(T,)``."""


class Phase(enum.Flag):
    """When a policy applies."""

    PREFILL = enum.auto()
    DECODE = enum.auto()
    BOTH = PREFILL | DECODE


@dataclass(frozen=True)
class Budget:
    """How many candidates to keep: a ratio in (0, 1] or an absolute token count.

    Exactly one of ``ratio`` and ``tokens`` is set. ``Budget.parse`` accepts
    ``0.25`` / ``"0.25"`` (ratio) and ``512`` / ``"512"`` (tokens).
    """

    ratio: float | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.tokens is None):
            raise ValueError("a Budget needs exactly one of ratio= or tokens=")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"budget ratio must be in (0, 1], got {self.ratio}")
        if self.tokens is not None and self.tokens <= 0:
            raise ValueError(f"budget tokens must be > 0, got {self.tokens}")

    @classmethod
    def parse(cls, value: Budget | float | int | str) -> Budget:
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise ValueError(f"budget must be a ratio in (0, 1] or a token count, got {value!r}")
        if isinstance(value, str):
            text = value.strip()
            try:
                value = int(text) if text.isdigit() else float(text)
            except ValueError:
                raise ValueError(
                    f"budget must be a ratio in (0, 1] or a token count, got {value!r}"
                ) from None
        if isinstance(value, int):
            return cls(tokens=value)
        if isinstance(value, float):
            return cls(ratio=value)
        raise ValueError(f"budget must be a ratio in (0, 1] or a token count, got {value!r}")

    def resolve(self, length: int) -> int:
        """Number of candidates to keep out of ``length`` (at least 1)."""
        if self.tokens is not None:
            if self.tokens > length:
                raise ValueError(
                    f"budget of {self.tokens} tokens exceeds the sequence length {length}; "
                    f"allowed: 1..{length} tokens or a ratio in (0, 1]"
                )
            return self.tokens
        assert self.ratio is not None
        return max(1, min(length, round(self.ratio * length)))

    def __str__(self) -> str:
        return f"{self.ratio:g}" if self.ratio is not None else str(self.tokens)


@dataclass
class LayerObservation:
    """What a policy may read about one layer of one sequence.

    Shapes use ``H`` = kv heads, ``T`` = candidates, ``W`` = window queries.

    Attributes:
        keys: ``(H, T, head_dim)`` post-RoPE keys, or None.
        values: ``(H, T, head_dim)`` values, or None.
        window_scores: ``(H, T)`` softmax attention mass from the observation
            window, summed over window queries and averaged over the query heads
            of each KV group, or None.
        window_attention: ``(H, W, T)`` per-query window attention rows, or None.
        cumulative_scores: ``(H, T)`` attention mass accumulated over every
            query seen so far (H2O), or None.
    """

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    window_scores: torch.Tensor | None = None
    window_attention: torch.Tensor | None = None
    cumulative_scores: torch.Tensor | None = None


@dataclass
class CompactionInputs:
    """Everything a policy sees for one sequence.

    Attributes:
        num_candidates: T, the number of candidate slots per head.
        num_kv_heads: H.
        layers: One observation per layer.
        positions: ``(H, T)`` original positions of the candidates; None means
            ``arange(T)`` for every head (end of prefill).
        valid: ``(H, T)`` bool, False for padding slots; None means all valid.
        special_mask: ``(T,)`` bool, candidate is a special token (BOS, ...).
        punctuation_mask: ``(T,)`` bool, candidate is punctuation.
        budget_tokens: Optional override of the policy's budget in tokens
            (decode-time callers keep a fixed count).
    """

    num_candidates: int
    num_kv_heads: int
    layers: list[LayerObservation]
    positions: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    special_mask: torch.Tensor | None = None
    punctuation_mask: torch.Tensor | None = None
    budget_tokens: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def positions_or_arange(self) -> torch.Tensor:
        """``(H, T)`` original positions (arange when not given)."""
        if self.positions is not None:
            return self.positions
        return torch.arange(self.num_candidates).expand(self.num_kv_heads, -1)

    def valid_or_all(self) -> torch.Tensor:
        """``(H, T)`` validity mask (all True when not given)."""
        if self.valid is not None:
            return self.valid
        return torch.ones(self.num_kv_heads, self.num_candidates, dtype=torch.bool)

    def valid_counts(self) -> torch.Tensor:
        """``(H,)`` number of valid candidates per head."""
        return self.valid_or_all().sum(dim=-1)


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
        """Tokens to keep per head: the override, else the budget resolved on T."""
        length = inputs.num_candidates if available is None else available
        if inputs.budget_tokens is not None:
            return max(0, min(inputs.budget_tokens, length))
        return self.budget.resolve(length)

    def require(self, inputs: CompactionInputs, attribute: str) -> list[torch.Tensor]:
        """Per-layer tensors of ``attribute``, validated to be present and ``(H, T, ...)``."""
        tensors: list[torch.Tensor] = []
        for index, layer in enumerate(inputs.layers):
            value = getattr(layer, attribute)
            if value is None:
                raise ValueError(
                    f"policy {self.name!r} needs {attribute} but layer {index} has none"
                )
            token_dim = 1 if attribute in ("keys", "values") else value.dim() - 1
            if value.shape[0] != inputs.num_kv_heads or value.shape[token_dim] != (
                inputs.num_candidates
            ):
                raise ValueError(
                    f"policy {self.name!r}: layer {index} {attribute} has shape "
                    f"{tuple(value.shape)}; expected {inputs.num_kv_heads} kv heads first and "
                    f"{inputs.num_candidates} candidates in dim {token_dim}"
                )
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
        needs = [n.name for n in Need if n in cls.needs and n.name]
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


def topk_keep(scores: torch.Tensor, k: int | torch.Tensor, valid: torch.Tensor | None = None) -> list[
    torch.Tensor
]:
    """Per head, the sorted indices of the ``k`` highest scores among valid candidates.

    Args:
        scores: ``(H, T)`` float scores (higher is kept first).
        k: Tokens to keep, one int for all heads or an ``(H,)`` tensor.
        valid: ``(H, T)`` bool mask; invalid candidates are never kept.

    Returns:
        ``H`` sorted int64 CPU tensors of candidate indices.
    """
    scores = scores.detach().float().cpu()
    if valid is not None:
        scores = scores.masked_fill(~valid.cpu(), float("-inf"))
        available = valid.cpu().sum(dim=-1)
    else:
        available = torch.full((scores.shape[0],), scores.shape[1])
    counts = torch.as_tensor(k, dtype=torch.int64).expand(scores.shape[0])
    counts = torch.minimum(counts, available)
    kept: list[torch.Tensor] = []
    for head in range(scores.shape[0]):
        n = int(counts[head])
        if n <= 0:
            kept.append(torch.empty(0, dtype=torch.int64))
            continue
        # stable tie-break towards later (more recent) candidates
        idx = torch.topk(scores[head], n, sorted=False).indices
        kept.append(torch.sort(idx).values)
    return kept


def plan_from_scores(
    policy: CompactionPolicy, inputs: CompactionInputs, per_layer_scores: list[torch.Tensor],
    keep_per_layer: list[int] | None = None,
) -> KeepPlan:
    """Top-k per (layer, head) over ``per_layer_scores`` (each ``(H, T)``)."""
    valid = inputs.valid
    layers = []
    for index, scores in enumerate(per_layer_scores):
        k = keep_per_layer[index] if keep_per_layer is not None else policy.keep_count(inputs)
        layers.append(tuple(topk_keep(scores, k, valid)))
    return KeepPlan(seq_len=inputs.num_candidates, kept=tuple(layers))


@dataclass
class ScorePolicy(CompactionPolicy):
    """A policy that scores candidates per (layer, head) and keeps the top ``budget``.

    Subclasses implement :meth:`score`; selection, validity masking and budget
    resolution live here so a method is a few lines (StreamingLLM, KNorm, ...).
    """

    @abstractmethod
    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        """``(H, T)`` float scores for ``layer``; +inf forces a keep."""

    def plan(self, inputs: CompactionInputs) -> KeepPlan:
        scores = [self.score(inputs, layer) for layer in range(inputs.num_layers)]
        for index, s in enumerate(scores):
            if tuple(s.shape) != (inputs.num_kv_heads, inputs.num_candidates):
                raise ValueError(
                    f"policy {self.name!r} scored layer {index} with shape {tuple(s.shape)}, "
                    f"expected ({inputs.num_kv_heads}, {inputs.num_candidates})"
                )
        return plan_from_scores(self, inputs, scores)
