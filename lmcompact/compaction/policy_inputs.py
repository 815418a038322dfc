"""Policy inputs (:class:`~lmcompact.policies.CompactionInputs`) built in one place.

Every path that asks a policy for a plan (the vLLM connector's saves and in-place packs,
the transformers caches, the kvpress comparison bench, the start-up probe of a policy's
plan shape) describes what it has for one layer of one sequence (keys, captured queries,
scores observed earlier) and gets the policy's :class:`~lmcompact.policies.LayerObservation`
from :func:`layer_observation`, which computes exactly the fields the policy's ``needs``
ask for; :func:`compaction_inputs` wraps the layers. A policy thus sees the same fields
whichever engine runs it::

    keys (H, T, D)  window: Queries  sample: Queries  every query  observed scores
          \\             |                |                |              /
           layer_observation(needs, ...)  ->  LayerObservation (needed fields only)
                 window_scores / window_attention   the window's queries (causal)
                 cumulative_scores                  every query of the span (H2O)
                 context_scores                     the policy's sample (KVzip)
                 window_queries                     window + sample (Expected Attention)

Positions are absolute: key ``i`` is at ``start + i``, a query at its ``positions`` entry.
Torch only (and the optional Triton window-score kernel): no engine imports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from lmcompact.attention.rope import Rope
from lmcompact.attention.scores import context_scores, cumulative_scores, window_scores
from lmcompact.kernels import dispatch as kernels
from lmcompact.policies import CompactionInputs, LayerObservation, Need

__all__ = [
    "SCORE_NEEDS",
    "Queries",
    "compaction_inputs",
    "joined_positions",
    "layer_observation",
    "probe_inputs",
    "prompt_observations",
    "score_window",
    "slice_candidates",
    "window_positions",
]

SCORE_NEEDS = Need.WINDOW_SCORES | Need.WINDOW_ATTENTION
"""Needs served by scoring the observation window."""


@dataclass
class Queries:
    """Post-RoPE queries of one sequence at absolute positions.

    Attributes:
        queries: ``(Hq, S, D)``.
        positions: ``(S,)`` their positions, ascending.
    """

    queries: torch.Tensor
    positions: torch.Tensor

    def join(self, other: Queries | None) -> Queries:
        """These queries and ``other``'s, ascending by position, each position once
        (:func:`joined_positions`)."""
        if other is None:
            return self
        positions = torch.cat([other.positions.cpu(), self.positions.cpu()])
        queries = torch.cat([other.queries.to(self.queries.device), self.queries], dim=1)
        unique, inverse = torch.unique(positions, sorted=True, return_inverse=True)
        first = torch.full((unique.numel(),), positions.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(positions.numel()), reduce="amin")
        return Queries(queries[:, first.to(queries.device)], unique)


def window_positions(length: int, window: int) -> torch.Tensor:
    """``(W,)`` positions of a prompt's observation window: its last ``window`` tokens
    (clipped to ``[1, length]``)."""
    w = max(1, min(window, length))
    return torch.arange(length - w, length)


def joined_positions(window: torch.Tensor, sample: torch.Tensor | None) -> torch.Tensor:
    """Positions of the ``window_queries`` a policy reads: the window's and the policy's
    context sample's, ascending, each once (the order of :meth:`Queries.join`)."""
    if sample is None:
        return window
    return torch.cat([sample.cpu(), window.cpu()]).unique()


def score_window(
    keys: torch.Tensor,
    window: Queries,
    *,
    scale: float | None,
    start: int = 0,
    rows: bool = False,
    kernel_dtype: torch.dtype | None = None,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Window mass ``(H, T)`` float32 of one layer, and its per-query rows ``(H, W, T)``
    when ``rows`` (:func:`lmcompact.attention.scores.window_scores`, causal by position;
    ``scale`` None: ``1 / sqrt(head_dim)``).

    ``kernel_dtype`` given, keys on CUDA and no rows asked: the Triton kernel
    (:func:`lmcompact.kernels.dispatch.window_scores`) in that dtype (the cache dtype, so
    the cast is exact). Otherwise the torch reference in float32, ``chunk_size`` keys at
    a time.
    """
    q = window.queries.to(keys.device).unsqueeze(0)  # (1, Hq, W, D)
    positions = window.positions.to(keys.device) - start
    if kernel_dtype is not None and not rows and kernels.use_kernels(keys.device):
        mass = kernels.window_scores(
            q.to(kernel_dtype).contiguous(),
            keys.unsqueeze(0).to(kernel_dtype),
            query_positions=positions,
            scale=scale,
        )
        return mass[0], None
    mass, attention = window_scores(
        q,
        keys.unsqueeze(0),
        query_positions=positions,
        scale=scale,
        chunk_size=chunk_size,
        return_attention=rows,
    )
    return mass[0], None if attention is None else attention[0]


def layer_observation(
    needs: Need,
    keys: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    *,
    window: Queries | None = None,
    sample: Queries | None = None,
    every_query: torch.Tensor | None = None,
    observed: LayerObservation | None = None,
    scale: float | None = None,
    start: int = 0,
    context_shift: int | None = None,
    rope: Rope | None = None,
    kernel_dtype: torch.dtype | None = None,
    chunk_size: int = 4096,
    timings: dict[str, float] | None = None,
) -> LayerObservation:
    """What a policy with ``needs`` reads about one layer of one sequence.

    A field is set only when ``needs`` asks for it: taken from ``observed`` when that
    has it, else computed from the queries given (None when they are missing: the
    policy's input check then says what is absent).

    Args:
        needs: The policy's needs.
        keys: ``(H, T, D)`` post-RoPE keys of the candidates (key ``i`` at position
            ``start + i``); the policy gets them (and ``values``) with ``Need.KEYS``.
        values: ``(H, T, D)``.
        window: The observation window's queries: window scores and rows.
        sample: The queries at the policy's ``context_queries``: context scores.
        every_query: ``(Hq, T, D)`` the queries at the candidates' own positions (every
            query of the span): cumulative scores.
        observed: Fields observed earlier (inside the attention forward, at copy time,
            by a recorder, by a reconstruction pass); they win over computing.
        scale: Softmax scale of the model's attention (default ``1 / sqrt(head_dim)``).
        start: Position of key 0.
        context_shift: The policy's ``context_shift``; used only with ``rope``, else the
            context scores are causal.
        rope: The model's RoPE, when known.
        kernel_dtype: Window mass through the Triton kernel on CUDA in this dtype (see
            :func:`score_window`); None: the torch reference.
        chunk_size: Keys per chunk of the reference window scores.
        timings: If given, ``observe_window_s``, ``observe_cumulative_s``,
            ``observe_context_s`` and ``observe_s`` grow by the seconds spent.
    """
    given = observed if observed is not None else LayerObservation()
    out = LayerObservation()
    if keys is None:
        keys = given.keys
    if values is None:
        values = given.values
    if Need.KEYS in needs:
        out.keys, out.values = keys, values
    begin = time.perf_counter()
    wants_mass = Need.WINDOW_SCORES in needs and given.window_scores is None
    wants_rows = Need.WINDOW_ATTENTION in needs and given.window_attention is None
    mass = rows = None
    scored = _nonempty(window)
    if (wants_mass or wants_rows) and keys is not None and scored is not None:
        mass, rows = score_window(
            keys,
            scored,
            scale=scale,
            start=start,
            rows=wants_rows,
            kernel_dtype=kernel_dtype,
            chunk_size=chunk_size,
        )
    if Need.WINDOW_SCORES in needs:
        out.window_scores = given.window_scores if given.window_scores is not None else mass
    if Need.WINDOW_ATTENTION in needs:
        out.window_attention = (
            given.window_attention if given.window_attention is not None else rows
        )
    if Need.WINDOW_QUERIES in needs:
        out.window_queries = given.window_queries
        if out.window_queries is None and window is not None:
            out.window_queries = window.join(sample).queries
    middle = time.perf_counter()
    if Need.CUMULATIVE_SCORES in needs:
        out.cumulative_scores = given.cumulative_scores
        if out.cumulative_scores is None and keys is not None and every_query is not None:
            out.cumulative_scores = cumulative_scores(
                every_query.to(keys.device).unsqueeze(0), keys.unsqueeze(0), scale=scale
            )[0]
    after_cumulative = time.perf_counter()
    if Need.CONTEXT_SCORES in needs:
        out.context_scores = given.context_scores
        sampled = _nonempty(sample)
        if out.context_scores is None and keys is not None and sampled is not None:
            out.context_scores = context_scores(
                sampled.queries.to(keys.device).unsqueeze(0),
                keys.unsqueeze(0),
                sampled.positions.to(keys.device) - start,
                scale=scale,
                shift=context_shift if rope is not None else None,
                rope=rope,
            )[0]
    end = time.perf_counter()
    if timings is not None:
        for name, seconds in (
            ("observe_window_s", middle - begin),
            ("observe_cumulative_s", after_cumulative - middle),
            ("observe_context_s", end - after_cumulative),
            ("observe_s", end - begin),
        ):
            timings[name] = timings.get(name, 0.0) + seconds
    return out


def _nonempty(queries: Queries | None) -> Queries | None:
    return queries if queries is not None and queries.queries.shape[1] > 0 else None


def prompt_observations(
    needs: Need,
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    window: int,
    scale: float,
    context_positions: torch.Tensor | None = None,
    context_shift: int | None = None,
    rope: Rope | None = None,
    timings: dict[str, float] | None = None,
) -> list[LayerObservation]:
    """One layer's scores from a prefill forward, one observation per row (no keys:
    they join when the policy plans, :func:`layer_observation`'s ``observed``).

    Args:
        needs: The policy's needs; only these are computed.
        queries: ``(B, Hq, T, D)`` post-RoPE queries of the whole prompt.
        keys: ``(B, Hkv, T, D)`` post-RoPE keys.
        window: Observation window length (:func:`window_positions`).
        scale: Softmax scale of the model's attention.
        context_positions: ``(S,)`` positions of the policy's ``context_queries``:
            context scores, and with ``WINDOW_QUERIES`` their queries join the window's.
        context_shift, rope, timings: As for :func:`layer_observation`.

    Raises:
        ValueError: ``needs`` has ``CONTEXT_SCORES`` and no ``context_positions``.
    """
    if Need.CONTEXT_SCORES in needs and context_positions is None:
        raise ValueError("CONTEXT_SCORES needs context_positions (the policy's sample)")
    t = keys.shape[2]
    positions = window_positions(t, window)
    sampled = context_positions is not None and bool(
        needs & (Need.CONTEXT_SCORES | Need.WINDOW_QUERIES)
    )
    out = []
    for b in range(keys.shape[0]):
        rows = queries[b]
        sample = None
        if sampled:
            assert context_positions is not None
            sample = Queries(rows[:, context_positions.to(rows.device)], context_positions.cpu())
        out.append(
            layer_observation(
                needs & ~Need.KEYS,
                keys[b],
                window=Queries(rows[:, t - positions.numel() :], positions),
                sample=sample,
                every_query=rows,
                scale=scale,
                context_shift=context_shift,
                rope=rope,
                timings=timings,
            )
        )
    return out


def slice_candidates(obs: LayerObservation, lo: int, hi: int) -> LayerObservation:
    """The observation of candidates ``[lo, hi)`` (window queries stay whole)."""

    def cut(tensor: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        return None if tensor is None else tensor.narrow(dim, lo, hi - lo)

    return replace(
        obs,
        keys=cut(obs.keys, 1),
        values=cut(obs.values, 1),
        window_scores=cut(obs.window_scores, 1),
        window_attention=cut(obs.window_attention, 2),
        cumulative_scores=cut(obs.cumulative_scores, 1),
        context_scores=cut(obs.context_scores, 1),
    )


def compaction_inputs(
    needs: Need,
    layers: list[LayerObservation],
    num_candidates: int,
    num_kv_heads: int,
    *,
    positions: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    token_masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    budget_tokens: int | None = None,
    max_tokens: int | None = None,
    max_layer_tokens: int | None = None,
    query_positions: torch.Tensor | None = None,
    rope: Rope | None = None,
    attention_scale: float | None = None,
) -> CompactionInputs:
    """A policy's inputs for one sequence from its layers' observations.

    ``token_masks`` (special, punctuation) and ``query_positions`` (of the layers'
    ``window_queries``) are passed on only when ``needs`` reads them; the other fields
    are :class:`~lmcompact.policies.CompactionInputs`'.
    """
    special = punctuation = None
    if token_masks is not None and Need.TOKEN_CLASSES in needs:
        special, punctuation = token_masks
    return CompactionInputs(
        num_candidates=num_candidates,
        num_kv_heads=num_kv_heads,
        layers=layers,
        positions=positions,
        valid=valid,
        special_mask=special,
        punctuation_mask=punctuation,
        budget_tokens=budget_tokens,
        max_tokens=max_tokens,
        max_layer_tokens=max_layer_tokens,
        query_positions=query_positions if Need.WINDOW_QUERIES in needs else None,
        rope=rope,
        attention_scale=attention_scale,
    )


def probe_inputs(
    num_tokens: int,
    window: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kept: int,
    generator: torch.Generator,
) -> CompactionInputs:
    """Random inputs of an engine's shape with every observation filled, to check the
    shape of a policy's plan at start-up (``kept`` tokens per (layer, head) asked)."""
    t = num_tokens
    w = max(1, min(window, t))
    layers = []
    for _ in range(num_layers):
        keys = torch.randn(num_kv_heads, t, head_dim, generator=generator)
        layers.append(
            LayerObservation(
                keys=keys,
                values=torch.randn(keys.shape, generator=generator),
                window_scores=torch.rand(num_kv_heads, t, generator=generator),
                window_attention=torch.rand(num_kv_heads, w, t, generator=generator),
                context_scores=torch.rand(num_kv_heads, t, generator=generator),
                window_queries=torch.randn(num_kv_heads, w, head_dim, generator=generator),
            )
        )
    return CompactionInputs(
        t, num_kv_heads, layers, budget_tokens=kept, query_positions=torch.arange(t, t + w)
    )
