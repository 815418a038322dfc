"""What a policy reads (:class:`Need`), when it applies (:class:`Phase`) and its inputs.

Inputs are *candidates*: at the end of prefill the candidates are the prompt's tokens
(candidate ``i`` is position ``i``); during decode they are the tokens a cache
currently holds, padded to a common length with ``valid`` marking real entries and
``positions`` giving their original positions. :func:`check_structure` holds the
shape checks every policy shares.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from lmcompact.attention.rope import Rope


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
    positions (``CompactionInputs.query_positions``), together with those at the policy's
    :meth:`CompactionPolicy.context_queries` when it samples any (sorted by position)."""


class Phase(enum.Flag):
    """When a policy applies."""

    PREFILL = enum.auto()
    DECODE = enum.auto()
    BOTH = PREFILL | DECODE


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
        max_tokens: Most tokens one (layer, head) may keep where the caller's layout
            holds per-head counts (the vLLM store's ``store.per_head`` cap, the in-place
            pack's ``release.per_head`` cap); None: every (layer, head) keeps the budget's
            count. Only policies with ragged counts read it (kvzip's
            ``allocation="ragged"``, Ada-KV).
        max_layer_tokens: With ``max_tokens``, most tokens one layer's heads keep
            together (the cells the caller's dense layout reserves); None: no bound.
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
    max_tokens: int | None = None
    max_layer_tokens: int | None = None
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


def check_layer_tensor(
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


def check_window_queries(
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
                check_layer_tensor(policy, inputs, index, attribute, value)
        if layer.window_queries is not None:
            check_window_queries(policy, inputs, index, layer)
        if (
            layer.keys is not None
            and layer.values is not None
            and (layer.keys.shape != layer.values.shape)
        ):
            raise ValueError(
                f"policy {policy!r}: layer {index} keys {tuple(layer.keys.shape)} and values "
                f"{tuple(layer.values.shape)} differ in shape"
            )
