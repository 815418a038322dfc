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

from lmcompact.attention.rope import Rope
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
    CONTEXT_SCORES = enum.auto()
    """Per key, the max softmax weight over sampled prompt queries ``(kv_heads, T)``
    (the queries at :meth:`CompactionPolicy.context_queries`, causal)."""
    WINDOW_QUERIES = enum.auto()
    """The observation window's post-RoPE queries ``(q_heads, W, head_dim)`` and their
    positions (``CompactionInputs.query_positions``)."""


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
        """``"0.25"`` for ratios (always with a point: ``"1.0"``), ``"512"`` for tokens;
        :meth:`parse` reads it back to the same budget."""
        if self.ratio is None:
            return str(self.tokens)
        text = f"{self.ratio:g}"
        return text if any(c in text for c in ".e") else text + ".0"


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
        context_scores: ``(H, T)`` per key, the largest softmax weight it gets from
            the sampled prompt queries (:func:`lmcompact.attention.scores.context_scores`),
            or None.
        window_queries: ``(Hq, W, head_dim)`` post-RoPE window queries (``Hq`` a
            multiple of ``H``), or None; positions in ``CompactionInputs.query_positions``.
    """

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    window_scores: torch.Tensor | None = None
    window_attention: torch.Tensor | None = None
    cumulative_scores: torch.Tensor | None = None
    context_scores: torch.Tensor | None = None
    window_queries: torch.Tensor | None = None


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
        query_positions: ``(W,)`` absolute positions of the window queries (with
            ``window_queries``); the future starts after the largest.
        rope: The model's rotary embedding, when the integration knows it (Expected
            Attention rotates query statistics to future positions with it).
        attention_scale: The model's softmax scale; None means ``1 / sqrt(head_dim)``.
    """

    num_candidates: int
    num_kv_heads: int
    layers: list[LayerObservation]
    positions: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    special_mask: torch.Tensor | None = None
    punctuation_mask: torch.Tensor | None = None
    budget_tokens: int | None = None
    query_positions: torch.Tensor | None = None
    rope: Rope | None = None
    attention_scale: float | None = None

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


_LAYER_RANKS = {
    "keys": 3,
    "values": 3,
    "window_scores": 2,
    "window_attention": 3,
    "cumulative_scores": 2,
    "context_scores": 2,
}


def need_names(needs: Need) -> list[str]:
    """Names of the flags set in ``needs`` (``["KEYS", ...]``)."""
    return [n.name for n in Need if n in needs and n.name and n is not Need.NOTHING]


def _check_layer_tensor(
    policy: str, inputs: CompactionInputs, index: int, attribute: str, value: torch.Tensor
) -> None:
    rank = _LAYER_RANKS[attribute]
    token_dim = 1 if attribute in ("keys", "values") else rank - 1
    expected = {
        "keys": "(kv_heads, T, head_dim)",
        "values": "(kv_heads, T, head_dim)",
        "window_scores": "(kv_heads, T)",
        "window_attention": "(kv_heads, W, T)",
        "cumulative_scores": "(kv_heads, T)",
        "context_scores": "(kv_heads, T)",
    }[attribute]
    if (
        value.dim() != rank
        or value.shape[0] != inputs.num_kv_heads
        or value.shape[token_dim] != inputs.num_candidates
    ):
        raise ValueError(
            f"policy {policy!r}: layer {index} {attribute} has shape {tuple(value.shape)}; "
            f"expected {expected} with kv_heads={inputs.num_kv_heads} and "
            f"T={inputs.num_candidates} (the keys and scores of a layer must agree)"
        )


def _check_window_queries(
    policy: str, inputs: CompactionInputs, index: int, layer: LayerObservation
) -> None:
    queries = layer.window_queries
    assert queries is not None
    h = inputs.num_kv_heads
    if queries.dim() != 3 or queries.shape[0] % h or queries.shape[0] == 0:
        raise ValueError(
            f"policy {policy!r}: layer {index} window_queries has shape {tuple(queries.shape)}; "
            f"expected (q_heads, W, head_dim) with q_heads a multiple of kv_heads={h}"
        )
    if layer.keys is not None and queries.shape[-1] != layer.keys.shape[-1]:
        raise ValueError(
            f"policy {policy!r}: layer {index} window_queries head_dim {queries.shape[-1]} "
            f"differs from the keys' {layer.keys.shape[-1]}"
        )
    positions = inputs.query_positions
    if positions is None or tuple(positions.shape) != (queries.shape[1],):
        got = None if positions is None else tuple(positions.shape)
        raise ValueError(
            f"policy {policy!r}: window_queries of layer {index} need query_positions of shape "
            f"({queries.shape[1]},), got {got}"
        )


def check_structure(policy: str, inputs: CompactionInputs) -> None:
    """Structure checks every policy shares (shapes of everything that is present)."""
    h, t = inputs.num_kv_heads, inputs.num_candidates
    if not inputs.layers:
        raise ValueError(f"policy {policy!r}: inputs have no layers; give one observation each")
    if h <= 0 or t <= 0:
        raise ValueError(
            f"policy {policy!r}: num_kv_heads and num_candidates must be > 0, got {h} and {t}"
        )
    for name in ("positions", "valid"):
        value = getattr(inputs, name)
        if value is not None and tuple(value.shape) != (h, t):
            raise ValueError(
                f"policy {policy!r}: {name} has shape {tuple(value.shape)}, expected ({h}, {t})"
            )
    if inputs.valid is not None and inputs.valid.dtype != torch.bool:
        raise ValueError(
            f"policy {policy!r}: valid must be a bool tensor, got {inputs.valid.dtype}"
        )
    for name in ("special_mask", "punctuation_mask"):
        value = getattr(inputs, name)
        if value is not None and (tuple(value.shape) != (t,) or value.dtype != torch.bool):
            raise ValueError(
                f"policy {policy!r}: {name} must be a bool tensor of shape ({t},), got "
                f"{value.dtype} {tuple(value.shape)}"
            )
    for index, layer in enumerate(inputs.layers):
        for attribute in _LAYER_RANKS:
            value = getattr(layer, attribute)
            if value is not None:
                _check_layer_tensor(policy, inputs, index, attribute, value)
        if layer.window_queries is not None:
            _check_window_queries(policy, inputs, index, layer)
        if (
            layer.keys is not None
            and layer.values is not None
            and (layer.keys.shape != layer.values.shape)
        ):
            raise ValueError(
                f"policy {policy!r}: layer {index} keys {tuple(layer.keys.shape)} and values "
                f"{tuple(layer.values.shape)} differ in shape"
            )


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
                _check_window_queries(self.name, inputs, index, layer)
            else:
                _check_layer_tensor(self.name, inputs, index, attribute, value)
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


def topk_keep(
    scores: torch.Tensor, k: int | torch.Tensor, valid: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Per head, the sorted indices of the ``k`` highest scores among valid candidates.

    Ties go to the later (more recent) candidate, so results are deterministic.
    Invalid candidates are never kept, whatever their score (even ``-inf``
    valid candidates rank above them).

    Args:
        scores: ``(H, T)`` float scores (higher is kept first; NaN is an error).
        k: Tokens to keep, one int for all heads or an ``(H,)`` tensor.
        valid: ``(H, T)`` bool mask; invalid candidates are never kept.

    Returns:
        ``H`` sorted int64 CPU tensors of candidate indices; head ``h`` keeps
        ``min(k[h], valid[h].sum())`` of them.
    """
    return _rows_of(topk_mask(scores, k, valid))


def topk_mask(
    scores: torch.Tensor, k: int | torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``(R, T)`` bool CPU mask of :func:`topk_keep`'s choice, for any number of rows.

    One sort over all rows (callers stack every layer's heads into ``R``), so
    the cost is a few tensor ops whatever the number of layers and heads.
    """
    # sort where the scores are (a GPU sorts every layer's heads in well under a
    # millisecond; a host sort of 32 x 8 x 16k doubles takes a good part of a second)
    device = scores.device
    scores = scores.detach().double()
    num_rows, length = scores.shape
    valid_on = None if valid is None else valid.to(device)
    if valid_on is None:
        if bool(torch.isnan(scores).any()):
            raise ValueError(
                "scores contain NaN for valid candidates; a policy must score every one"
            )
        available = torch.full((num_rows,), length, dtype=torch.int64, device=device)
    else:
        if bool(torch.isnan(scores[valid_on]).any()):
            raise ValueError(
                "scores contain NaN for valid candidates; a policy must score every one"
            )
        available = valid_on.sum(dim=-1)
    wanted = torch.as_tensor(k, dtype=torch.int64).to(device).expand(num_rows)
    counts = torch.minimum(wanted, available)
    order = descending_order(scores, valid_on)
    rank_of_slot = torch.empty_like(order)
    ranks = torch.arange(length, device=device).expand(num_rows, -1).contiguous()
    rank_of_slot.scatter_(-1, order, ranks)
    return (rank_of_slot < counts.clamp(min=0).unsqueeze(-1)).cpu()


def _rows_of(mask: torch.Tensor) -> list[torch.Tensor]:
    """Sorted int64 column indices of the True entries of each row of ``(R, T)`` ``mask``."""
    columns = torch.nonzero(mask, as_tuple=False)[:, 1]
    return list(torch.split(columns, mask.sum(dim=-1).tolist()))


def descending_order(scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``(H, T)`` candidate indices, best first: valid before invalid, then by score
    (descending), ties to the later candidate. ``valid=None`` means all valid."""
    flipped = torch.flip(scores, dims=[-1])
    order = torch.sort(flipped, dim=-1, descending=True, stable=True).indices
    order = scores.shape[-1] - 1 - order
    if valid is None or bool(valid.all()):
        return order
    rank_valid = torch.gather(valid, -1, order)
    regroup = torch.sort(rank_valid.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return torch.gather(order, -1, regroup)


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
    rows = _rows_of(topk_mask(scores.view(num_layers * heads, length), counts, valid))
    kept = tuple(tuple(rows[layer * heads : (layer + 1) * heads]) for layer in range(num_layers))
    return KeepPlan(seq_len=length, kept=kept)


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
        self.check_inputs(inputs)
        scores = self.score_all(inputs)
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
