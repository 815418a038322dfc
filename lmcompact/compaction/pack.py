"""Compact a fresh prefill where it lies: kept tokens move to the request's first slots.

Runs on the worker after the forward pass of the step that completed the prompt, on the
live paged cache, layer by layer::

    slots before   [ t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 tA tB | tC .. ]   num_tokens = 12
    head 0 keeps   t0 t5 tA tB  ->  [ t0 t5 tA tB | (hole ........) | tC .. ]
    head 1 keeps   t0 t1 t9 tB  ->  [ t0 t1 t9 tB | (hole ........) | tC .. ]

With prefix caching a request may start with blocks it shares with other requests
(``start`` > 0): those stay as they are, and the span ``[start, start + num_tokens)`` is
packed into slots ``[start, start + kept)``.

Each (layer, head) keeps the same number of tokens (``kept``, whole blocks), in original
order; slots hold post-RoPE keys, so which original token lands in which slot does not
matter to attention. All of a layer's K/V are read (a copy) before anything is written, so
a packed write never overwrites a token still to be read.

With per-head counts (``reserved`` given), each (layer, head) keeps the policy's own count,
clipped to ``head_cap``, a layer's heads together to ``reserved x H``, packed as dense cells
of slots ``[0, reserved)`` (:func:`lmcompact.compaction.per_head.pack_per_head`); the
per-head recompute attends to them (:mod:`lmcompact.compaction.per_head_attention`).

Engine-free: torch, the page layout and an lmcompact policy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch

from lmcompact.compaction.chunks import fit_layer
from lmcompact.compaction.kv_quant import Fp8Pages
from lmcompact.compaction.page_layout import PageLayout
from lmcompact.compaction.per_head import pack_per_head
from lmcompact.compaction.policy_inputs import Queries, compaction_inputs, layer_observation
from lmcompact.compaction.save_job import SAVE_CHUNK, uniform_keep
from lmcompact.plan import KeepPlan
from lmcompact.policies import CompactionPolicy, Need


@dataclass
class WindowQueries:
    """Post-RoPE queries of the prompt's last tokens, for score-based policies.

    Attributes:
        per_layer: per layer ``(W, Hq, D)`` queries.
        positions: ``(W,)`` their absolute positions.
        scale: attention softmax scale.
    """

    per_layer: list[torch.Tensor]
    positions: torch.Tensor
    scale: float


def plan_pack(
    per_layer: Sequence[tuple[torch.Tensor, torch.Tensor]],
    policy: CompactionPolicy,
    kept: int,
    window: WindowQueries | None,
    reserved: int | None = None,
    kernel_dtype: torch.dtype | None = None,
    recent_layers: frozenset[int] = frozenset(),
    start: int = 0,
    head_cap: int | None = None,
    timings: dict[str, float] | None = None,
) -> list[list[torch.Tensor]]:
    """Kept token indices per (layer, head), sorted, relative to the span's first token.

    Args:
        per_layer: per layer ``(H, T, D)`` keys and values of the span.
        policy: the compaction policy.
        kept: tokens each (layer, head) keeps (with ``reserved``: the mean asked for).
        window: window queries, or None (score-based policies then see no scores and
            fall back to their score-free behaviour, or raise).
        reserved: None: every list is exactly ``kept`` long. Else each keeps the policy's
            own count, clipped to ``[1, head_cap]``, each layer's to ``reserved x H`` in all
            (its dense cells, :func:`lmcompact.compaction.chunks.fit_layer`); when clipping
            brings the mean below ``kept``, the policy is asked for more until the clipped
            mean is ``kept`` again.
        kernel_dtype: dtype of the window-score kernel on CUDA (the cache dtype).
        recent_layers: sliding-window layers: they keep the span's ``kept`` most recent
            tokens whatever the policy chose (:meth:`lmcompact.plan.KeepPlan.with_recent`),
            so slot ``s`` holds token ``num_tokens - kept + s`` and vLLM's window mask by
            key index is the logical one. Not with ``reserved``.
        start: absolute position of the span's first token (window positions are absolute).
        head_cap: with ``reserved``, most tokens one (layer, head) keeps; None: ``reserved``.
        timings: if given, set to ``score_s`` (seconds reading and scoring the layers)
            and ``plans`` (how many plans the policy was asked for).
    """
    if recent_layers and reserved is not None:
        raise ValueError("per-head counts (reserved) cannot be combined with recent_layers")
    num_tokens = per_layer[0][0].shape[1]
    num_heads = per_layer[0][0].shape[0]
    needs = policy.needs
    # only the window's queries are captured here (no context sample): a policy that reads
    # window queries would see other statistics than on the save path, so it gets none
    # (the connector refuses it for the pack)
    observed = needs & ~Need.WINDOW_QUERIES
    observations = []
    began = time.perf_counter()
    positions: dict[torch.device, torch.Tensor] = {}  # one copy, not one wait per layer
    for index, (keys, values) in enumerate(per_layer):
        queries = None
        if window is not None:
            # window queries stay where they were captured; score where the keys are
            captured = window.per_layer[index].to(keys.device, torch.float32)
            if keys.device not in positions:
                positions[keys.device] = window.positions.to(keys.device)
            queries = Queries(captured.permute(1, 0, 2), positions[keys.device])
        observations.append(
            layer_observation(
                observed,
                keys,
                values,
                window=queries,
                scale=1.0 if window is None else window.scale,
                start=start,
                kernel_dtype=kernel_dtype or keys.dtype,
                chunk_size=SAVE_CHUNK,
            )
        )

    if timings is not None and num_tokens and per_layer[0][0].is_cuda:
        torch.cuda.synchronize()  # bill the asynchronous scoring to score_s, not plan_s
    scored_at = time.perf_counter()
    if timings is not None:
        timings["score_s"] = scored_at - began
        timings["plans"] = 0.0

    cap = reserved if head_cap is None or reserved is None else head_cap

    def plan_for(ask: int) -> KeepPlan:
        if timings is not None:
            timings["plans"] += 1
        return policy.plan(
            compaction_inputs(
                needs,
                observations,
                num_tokens,
                num_heads,
                budget_tokens=ask,
                # policies that read the caps (Ada-KV, kvzip ragged) fit the cells in one
                # plan; the others are clipped below
                max_tokens=cap,
                max_layer_tokens=None if reserved is None else reserved * num_heads,
            )
        )

    plan = plan_for(kept).with_recent(recent_layers, kept)
    heads = range(num_heads)
    layers = range(len(per_layer))
    if reserved is None:
        return [
            [uniform_keep(plan.kept[layer][head], kept, num_tokens) for head in heads]
            for layer in layers
        ]

    assert cap is not None  # reserved is set from here on

    def clipped(plan: KeepPlan) -> list[list[torch.Tensor]]:
        return [
            fit_layer(
                [_clip(plan.kept[layer][head], cap, num_tokens) for head in heads],
                reserved * num_heads,
                num_tokens,
            )
            for layer in layers
        ]

    def mean(chosen: list[list[torch.Tensor]]) -> float:
        return sum(k.numel() for heads_ in chosen for k in heads_) / (len(chosen) * num_heads)

    chosen = clipped(plan)
    if mean(chosen) >= kept:
        return chosen
    # Clipping to the caps lost tokens: ask for more until the mean is the budget again
    # (smallest such ask, by bisection; asking for every token fills every layer's cells,
    # ``reserved >= kept`` per head, so the search always ends with a mean >= the budget).
    lo, hi, best = kept + 1, num_tokens, None
    for _ in range(MAX_BUDGET_SEARCH):
        if lo > hi:
            break
        mid = (lo + hi) // 2
        candidate = clipped(plan_for(mid))
        if mean(candidate) >= kept:
            best, hi = candidate, mid - 1
        else:
            lo = mid + 1
    return best if best is not None else clipped(plan_for(num_tokens))


@dataclass(frozen=True)
class _LayerReads(Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """One layer's ``(H, num_tokens, D)`` K/V of the span, read from the pages on each access.

    Attributes:
        as_float: give float32 copies (what the policies score).
        fp8: decode fp8 page bytes to float32 with these scales.
    """

    kv_layers: Sequence[torch.Tensor]
    layout: PageLayout
    block_ids: Sequence[int]
    start: int
    num_tokens: int
    as_float: bool = False
    fp8: Fp8Pages | None = None

    def __len__(self) -> int:
        return len(self.kv_layers)

    @overload
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[torch.Tensor, torch.Tensor]]: ...

    def __getitem__(
        self, index: int | slice
    ) -> tuple[torch.Tensor, torch.Tensor] | Sequence[tuple[torch.Tensor, torch.Tensor]]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        keys, values = self.layout.read(
            self.kv_layers[index], self.block_ids, self.start, self.num_tokens
        )
        if self.fp8 is not None:
            return self.fp8.keys(index, keys), self.fp8.values(index, values)
        if self.as_float:
            return keys.float(), values.float()
        return keys, values


MAX_BUDGET_SEARCH = 12
"""Re-plans at most this many times to bring the clipped mean count back to the budget."""


def _clip(positions: torch.Tensor, reserved: int, length: int) -> torch.Tensor:
    """One head's own kept positions, at most ``reserved`` and at least one."""
    n = positions.numel()
    if 1 <= n <= reserved:
        return positions
    return uniform_keep(positions, reserved if n > reserved else 1, length)


def pack_in_place(
    kv_layers: Sequence[torch.Tensor],
    layout: PageLayout,
    block_ids: Sequence[int],
    num_tokens: int,
    kept: int,
    policy: CompactionPolicy,
    window: WindowQueries | None = None,
    reserved: int | None = None,
    recent_layers: frozenset[int] = frozenset(),
    start: int = 0,
    fp8: Fp8Pages | None = None,
    head_cap: int | None = None,
    timings: dict[str, float] | None = None,
) -> list[list[torch.Tensor]]:
    """Pack each (layer, head)'s kept tokens of ``[start, start + num_tokens)`` into slots
    ``[start, start + kept)``; slots before ``start`` are neither read nor written.

    Args:
        kv_layers: per layer paged cache ``(num_blocks, H, block_size, 2 * D)``.
        layout: page layout of those caches.
        block_ids: the request's block row (logical -> physical).
        num_tokens: tokens compacted; a multiple of the block size.
        kept: tokens kept per (layer, head); a multiple of the block size, < num_tokens.
        policy: chooses the kept tokens.
        window: window queries for score-based policies.
        reserved: per-head counts: slots a layer's dense cells take (block aligned,
            ``kept <= reserved < num_tokens``); each head keeps its own count (at most
            ``head_cap``), a layer's heads at most ``reserved x H`` together. None: every
            head keeps exactly ``kept``.
        recent_layers: sliding-window layers, which keep the most recent ``kept`` tokens
            (see :func:`plan_pack`).
        start: first token of the span (block aligned): blocks before it are shared with
            other requests through vLLM's prefix cache and stay untouched.
        fp8: the caches hold fp8 bytes: the policy scores their decoded numbers, and the
            bytes move untouched. Not with ``reserved``.
        head_cap: with ``reserved``, most tokens one (layer, head) keeps; None: ``reserved``.
        timings: a fresh dict to fill with ``score_s``, ``plan_s`` and ``plans``
            (:func:`plan_pack`); the caller times the whole pack.

    Returns:
        The kept indices per (layer, head); with ``reserved`` their lengths are the counts
        attention must use.
    """
    bs = layout.block_size
    slots = kept if reserved is None else reserved
    if num_tokens % bs or slots % bs or start % bs or not 0 < kept <= slots < num_tokens:
        raise ValueError(
            f"pack needs block-aligned 0 < kept <= reserved < num_tokens, got kept={kept}, "
            f"reserved={reserved}, num_tokens={num_tokens}, start={start}, block_size={bs}"
        )
    if start and reserved is not None:
        raise ValueError("per-head counts (reserved) pack from token 0 only")
    if fp8 is not None and reserved is not None:
        raise ValueError("per-head counts (reserved) are not supported on fp8 caches")
    # layers are read when used, one at a time (each read is a copy, taken before that
    # layer is written): holding every layer at once costs ~6 GB at 16k tokens of an 8B
    # model, more than vLLM leaves free beside its pool
    raw = _LayerReads(kv_layers, layout, block_ids, start, num_tokens)
    scored: Sequence[tuple[torch.Tensor, torch.Tensor]]
    if fp8 is None:
        scored = _LayerReads(kv_layers, layout, block_ids, start, num_tokens, as_float=True)
        kernel_dtype = kv_layers[0].dtype
    else:  # bytes stay bytes (gathered and written back as they are); scores read numbers
        scored = _LayerReads(kv_layers, layout, block_ids, start, num_tokens, fp8=fp8)
        kernel_dtype = torch.float32
    planned = time.perf_counter()
    chosen = plan_pack(
        scored,
        policy,
        kept,
        window,
        reserved,
        kernel_dtype,
        recent_layers,
        start,
        head_cap,
        timings,
    )
    if timings is not None:  # plan_s: all of plan_pack but the window scores
        timings["plan_s"] = time.perf_counter() - planned - timings["score_s"]
    if reserved is not None:
        pack_per_head(kv_layers, layout, block_ids, num_tokens, chosen, reserved)
        return chosen
    for layer, (kv, heads) in enumerate(zip(kv_layers, chosen, strict=True)):
        keys, values = raw[layer]
        index = torch.stack(heads).to(keys.device)  # (H, kept)
        gather = index.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        layout.write(
            kv, block_ids, start, torch.gather(keys, 1, gather), torch.gather(values, 1, gather)
        )
    return chosen
