"""The in-place pack without leaving the GPU: scores, pooling, top-k and K/V copy.

The torch reference (:func:`lmcompact.compaction.pack.plan_pack`) scores layer by layer,
asks the policy for a :class:`~lmcompact.plan.KeepPlan` and turns it into Python lists of
indices, which costs a host round trip per layer. Here every step covers all layers and
heads at once and stays on the device, so the host only launches work::

    pages  = gather_pages(all layers)            (L, T, H, 2D)   1 launch (token-major copy)
    mass   = window_scores(q, pages[..., :D])    (L, H, T)       3 launches (B = L)
    scores = policy scorer on (L, H, T)          float64         a few elementwise launches
    index  = stable descending sort, first K, ascending sort      (L, H, K)
    scatter_kept(pages, index) -> slots [0, K) of every (layer, head)   1 launch

Selection is the reference's, batched: ties go to the later token, each (layer, head)
keeps exactly ``K`` sorted indices. No ``.item()``, ``.tolist()`` or ``.cpu()`` on the
path; the block row and the window positions go up with non-blocking copies.

Block reuse: the hole's blocks return to vLLM's pool in the *next* ``schedule()``; the
first kernel that can write them is a forward pass launched after this pack on the same
(current) CUDA stream, so stream order alone guarantees the pack's reads of those blocks
(the gather) and its writes (the scatter) complete before. The temporary ``pages`` buffer
goes back to torch's caching allocator, which reuses it only in stream order too.

Policies with a device scorer: ``snapkv``, ``streaming_llm``, ``knorm``
(:data:`DEVICE_SCORERS`); others take the reference path.

Per-head counts (Ada-KV over a device scorer, PyramidKV; :meth:`DevicePacker.pack_per_head`)
take the same gather and scores; Ada-KV ranks every layer's ``(H x T)`` pairs at once,
PyramidKV's counts per layer (its cap and budget search included) are known on the host
before it selects (:func:`pyramid_counts`), and :func:`write_cells` lays the chosen pairs
out as dense cells (head after head, see :mod:`lmcompact.compaction.per_head`), the
reference's layout. DuoAttention's per-head packs take the reference path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from lmcompact.compaction.host_copies import values_on_device
from lmcompact.compaction.kv_quant import Fp8Pages
from lmcompact.compaction.save_job import SCORE_NEEDS
from lmcompact.kernels import dispatch as kernels
from lmcompact.policies import CompactionInputs, CompactionPolicy
from lmcompact.policies._select import pool_scores
from lmcompact.policies.adakv import AdaKV
from lmcompact.policies.base import descending_order
from lmcompact.policies.pyramidkv import PyramidKV

logger = logging.getLogger(__name__)

Scorer = Callable[[CompactionPolicy, "torch.Tensor | None", torch.Tensor, int], torch.Tensor]


def _snapkv(policy: CompactionPolicy, mass: torch.Tensor | None, keys: torch.Tensor, kept: int):
    """SnapKV of every layer at once; equals ``SnapKV.score`` layer by layer."""
    if mass is None:
        raise ValueError("snapkv needs window scores")
    layers, heads, length = mass.shape
    window = min(int(policy.window_size), kept, length)  # type: ignore[attr-defined]
    recent = torch.arange(length, device=mass.device) >= length - window  # (T,)
    prefix = mass.double().masked_fill(recent, 0.0)
    pooled = pool_scores(
        prefix.reshape(layers * heads, length),
        int(policy.kernel_size),  # type: ignore[attr-defined]
        str(policy.pooling),  # type: ignore[attr-defined]
    ).view(layers, heads, length)
    peak = prefix.abs().amax(dim=(1, 2), keepdim=True).clamp(min=1e-30)
    return (pooled + prefix / peak * 1e-9).masked_fill(recent, float("inf"))


def _streaming(policy: CompactionPolicy, mass: torch.Tensor | None, keys: torch.Tensor, kept: int):
    layers, heads, length = keys.shape[:3]
    positions = torch.arange(length, device=keys.device, dtype=torch.float64)
    sinks = int(policy.n_sink)  # type: ignore[attr-defined]
    score = torch.where(positions < sinks, float(length) + (sinks - positions), positions)
    return score.expand(layers, heads, length)


def _knorm(policy: CompactionPolicy, mass: torch.Tensor | None, keys: torch.Tensor, kept: int):
    return -torch.linalg.vector_norm(keys.float(), dim=-1).double()


DEVICE_SCORERS: dict[str, Scorer] = {
    "snapkv": _snapkv,
    "streaming_llm": _streaming,
    "knorm": _knorm,
}
"""Policy name -> ``(policy, mass (L, H, T) | None, keys (L, H, T, D), kept) -> (L, H, T)``
float64 scores, the same numbers the policy's ``score`` gives layer by layer."""


def device_scores(
    policy: CompactionPolicy, mass: torch.Tensor | None, keys: torch.Tensor, kept: int
) -> torch.Tensor:
    """``(L, H, T)`` float64 scores of every layer (+inf forces a keep)."""
    return DEVICE_SCORERS[policy.name](policy, mass, keys, kept)


def select_kept(scores: torch.Tensor, kept: int) -> torch.Tensor:
    """``(L, H, kept)`` int64 sorted indices of the best ``kept`` of ``(L, H, T)`` scores.

    The reference's order (:func:`lmcompact.policies.base.descending_order`): higher score
    first, ties to the later token.
    """
    layers, heads, length = scores.shape
    order = descending_order(scores.reshape(layers * heads, length), None)
    return order[:, :kept].sort(dim=-1).values.view(layers, heads, kept)


def write_cells(
    kv_layers: Sequence[torch.Tensor],
    row: torch.Tensor,
    pages: torch.Tensor,
    chosen: Sequence[torch.Tensor],
    reserved: int,
) -> None:
    """Write each layer's chosen ``(head, token)`` pairs as dense cells of slots
    ``[0, reserved)``; the layer's cells after them are zeroed.

    Args:
        kv_layers: per layer ``(num_blocks, H, bs, 2D)`` paged caches (written).
        row: the request's physical block ids (at least ``reserved / bs``), on their device.
        pages: ``(L, T, H, 2D)`` copy of the span (:func:`gather_pages`; not the caches).
        chosen: per layer, ``(N_l,)`` int64 ascending flat pairs ``head * T + token`` (head
            after head, tokens in order: cell ``j`` of layer ``l`` is pair ``chosen[l][j]``).
        reserved: slots of the cells (whole blocks, ``N_l <= reserved x H``).
    """
    layers, length, heads, width = pages.shape
    bs = kv_layers[0].shape[2]
    cells = reserved * heads
    if reserved % bs or len(chosen) != layers or any(len(c) > cells for c in chosen):
        raise ValueError(
            f"{[len(c) for c in chosen]} pairs per layer do not fit {layers} layers of "
            f"{reserved} block-aligned slots x {heads} heads"
        )
    blocks = row[: reserved // bs].to(kv_layers[0].device, torch.int64)
    image = torch.empty(cells, width, dtype=pages.dtype, device=pages.device)
    for layer, (kv, pairs) in enumerate(zip(kv_layers, chosen, strict=True)):
        image.zero_()
        image[: len(pairs)] = pages[layer, pairs % length, pairs // length]
        # cell (block b, head g, slot s) is b * bs * H + g * bs + s: the page order itself
        kv[blocks] = image.view(reserved // bs, heads, bs, width)


def pyramid_counts(
    policy: PyramidKV, kept: int, num_tokens: int, layers: int, cap: int, reserved: int
) -> tuple[int, list[int], list[int]]:
    """What :func:`lmcompact.compaction.pack.pack_in_place` with ``reserved`` settles on for
    PyramidKV, from counts alone: the budget it asks the policy for (the smallest whose
    clipped mean is ``kept`` again, by the same bisection), each layer's planned count per
    head, and that count after the head cap and the layer's ``reserved x H`` cells (a
    layer's heads keep equal counts, so the cut is the same for each).

    Returns:
        ``(ask, planned, final)``.
    """
    from lmcompact.compaction.pack import MAX_BUDGET_SEARCH

    def counts(ask: int) -> tuple[list[int], list[int]]:
        planned = policy.budgets_for(min(ask, num_tokens), num_tokens, layers)
        clipped = [max(1, min(n, cap)) for n in planned]  # _clip: in [1, cap]
        # a layer's heads keep equal counts: its cells' water level is ``reserved`` each
        return planned, [min(n, reserved) for n in clipped]

    def enough(ask: int) -> bool:
        return sum(counts(ask)[1]) >= kept * layers

    ask = kept
    if not enough(ask):
        lo, hi, best = kept + 1, num_tokens, None
        for _ in range(MAX_BUDGET_SEARCH):
            if lo > hi:
                break
            mid = (lo + hi) // 2
            if enough(mid):
                best, hi = mid, mid - 1
            else:
                lo = mid + 1
        ask = best if best is not None else num_tokens
    planned, final = counts(ask)
    return ask, planned, final


class DevicePacker:
    """Packs requests of one engine on the GPU; built once the KV caches are registered.

    Args:
        kv_layers: per layer ``(num_blocks, H, bs, 2D)`` token-major paged caches, in layer
            order, all on one CUDA device with one shape and stride.
        block_size: tokens per block.
        scale: attention softmax scale.
        fp8: the caches hold fp8 bytes: scores read the numbers they decode to (in
            ``score_dtype``), the scatter moves the bytes.
        score_dtype: dtype of the window-score kernel for fp8 caches (the model dtype);
            other caches score in their own dtype.
    """

    def __init__(
        self,
        kv_layers: Sequence[torch.Tensor],
        block_size: int,
        scale: float,
        fp8: Fp8Pages | None = None,
        score_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        from lmcompact.kernels.paged_pack import layer_pointers

        self.kv_layers = list(kv_layers)
        self.block_size = block_size
        self.scale = scale
        self.fp8 = fp8
        self.score_dtype = score_dtype if fp8 is not None else self.kv_layers[0].dtype
        self.device = self.kv_layers[0].device
        self.ptrs = layer_pointers(self.kv_layers)

    @staticmethod
    def supports(policy: CompactionPolicy) -> bool:
        return policy.name in DEVICE_SCORERS

    def pack(
        self,
        block_ids: Sequence[int],
        num_tokens: int,
        kept: int,
        policy: CompactionPolicy,
        queries: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Pack kept tokens of ``[0, num_tokens)`` into slots ``[0, kept)`` of every layer.

        Args:
            block_ids: the request's block row (at least ``num_tokens / bs`` entries).
            num_tokens: tokens compacted (whole blocks).
            kept: tokens each (layer, head) keeps (whole blocks, < num_tokens).
            policy: a policy with a device scorer.
            queries: ``(L, Hq, W, D)`` window queries (any dtype/device), or None for
                policies that need no scores.
            positions: ``(W,)`` their absolute positions.

        Returns:
            ``(L, H, kept)`` int64 kept token indices, on the device.
        """
        from lmcompact.kernels.paged_pack import scatter_kept

        row, pages, keys = self._read(block_ids, num_tokens)
        mass = self._mass(policy, keys, queries, positions)
        index = select_kept(device_scores(policy, mass, keys, kept), kept)
        scatter_kept(self.kv_layers, self.ptrs, row, pages, index)
        return index

    @staticmethod
    def supports_per_head(policy: CompactionPolicy) -> bool:
        """Ada-KV over a device scorer, with a safeguard (every head keeps >= 1 token), and
        PyramidKV (SnapKV's scores, a count per layer)."""
        if isinstance(policy, PyramidKV):
            return True
        return (
            isinstance(policy, AdaKV)
            and policy.inner.name in DEVICE_SCORERS
            and policy.alpha_safeguard > 0
        )

    def pack_per_head(
        self,
        block_ids: Sequence[int],
        num_tokens: int,
        kept: int,
        reserved: int,
        head_cap: int | None,
        policy: AdaKV | PyramidKV,
        queries: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Pack each (layer, head)'s own kept tokens of ``[0, num_tokens)`` as dense cells of
        slots ``[0, reserved)``, what :func:`lmcompact.compaction.pack.pack_in_place` with
        ``reserved`` does.

        Args:
            block_ids, num_tokens, queries, positions: as for :meth:`pack`.
            kept: mean tokens per (layer, head) (whole blocks).
            reserved: slots of a layer's cells (whole blocks, ``kept <= reserved <
                num_tokens``).
            head_cap: most tokens one (layer, head) keeps; None: ``reserved``.
            policy: Ada-KV or PyramidKV (:meth:`supports_per_head`).

        Returns:
            ``(L, H)`` int64 kept counts, on the device (PyramidKV's: on the host, known
            before the selection).
        """
        bs = self.block_size
        if reserved % bs or not 0 < kept <= reserved < num_tokens:
            raise ValueError(
                f"per-head pack needs block-aligned 0 < kept <= reserved < num_tokens, got "
                f"kept={kept}, reserved={reserved}, num_tokens={num_tokens}"
            )
        if self.fp8 is not None:
            raise ValueError("per-head counts are not supported on fp8 caches")
        row, pages, keys = self._read(block_ids, num_tokens)
        mass = self._mass(policy, keys, queries, positions)
        if isinstance(policy, PyramidKV):
            return self._pyramid_cells(row, pages, keys, mass, kept, reserved, head_cap, policy)
        scores = device_scores(policy.inner, mass, keys, kept)
        layers, heads, length = scores.shape
        inputs = CompactionInputs(
            length,
            heads,
            [],
            budget_tokens=kept,
            max_tokens=reserved if head_cap is None else head_cap,
            max_layer_tokens=reserved * heads,
        )
        chosen = policy.layer_choices(scores, inputs).sort(dim=1).values
        write_cells(self.kv_layers, row, pages, chosen.unbind(), reserved)
        counts = torch.zeros(layers, heads, dtype=torch.int64, device=self.device)
        return counts.scatter_add_(1, chosen // length, torch.ones_like(chosen))

    def _pyramid_cells(
        self,
        row: torch.Tensor,
        pages: torch.Tensor,
        keys: torch.Tensor,
        mass: torch.Tensor | None,
        kept: int,
        reserved: int,
        head_cap: int | None,
        policy: PyramidKV,
    ) -> torch.Tensor:
        """PyramidKV's per-head pack: the counts come from :func:`pyramid_counts` (no device
        read), each layer's heads keep their planned best, cut to the final count by the
        reference's rule (its first ``c // 2`` and last ``c - c // 2`` choices)."""
        layers, length, heads, _ = pages.shape
        cap = reserved if head_cap is None else head_cap
        ask, planned, final = pyramid_counts(policy, kept, length, layers, cap, reserved)
        scores = _snapkv(policy, mass, keys, min(ask, length))
        order = descending_order(scores.reshape(layers * heads, length), None)
        order = order.view(layers, heads, length)
        offsets = torch.arange(heads, device=order.device)[:, None] * length
        chosen = []
        for layer, (n, c) in enumerate(zip(planned, final, strict=True)):
            best = order[layer, :, :n].sort(dim=-1).values
            if c < n:
                best = torch.cat([best[:, : c // 2], best[:, n - (c - c // 2) :]], dim=1)
            chosen.append((best + offsets).flatten())
        write_cells(self.kv_layers, row, pages, chosen, reserved)
        return torch.tensor(final, dtype=torch.int64)[:, None].expand(layers, heads).clone()

    def _read(
        self, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The request's block row on the device, the ``(L, T, H, 2D)`` copy of its span and
        the ``(L, H, T, D)`` keys the scores read."""
        from lmcompact.kernels.paged_pack import gather_pages, gather_pages_reference

        nb = num_tokens // self.block_size
        row = values_on_device(list(block_ids[:nb]), torch.int64, self.device)
        if kernels.use_kernels(self.device):
            pages = gather_pages(self.kv_layers, self.ptrs, row)  # (L, T, H, 2D)
        else:  # the torch reference: the same pack on the CPU
            pages = gather_pages_reference(self.kv_layers, row)
        d = pages.shape[-1] // 2
        keys = pages[..., :d].permute(0, 2, 1, 3)  # (L, H, T, D) view, head_dim contiguous
        if self.fp8 is not None:
            keys = self.fp8.stacked_keys(keys).to(self.score_dtype).contiguous()
        return row, pages, keys

    def _mass(
        self,
        policy: CompactionPolicy,
        keys: torch.Tensor,
        queries: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """``(L, H, T)`` window attention mass, or None for a policy that reads no scores."""
        if not policy.needs & SCORE_NEEDS:
            return None
        if queries is None or positions is None:
            raise ValueError(f"{policy.name} needs window queries for a device pack")
        q = queries.to(self.device, keys.dtype, non_blocking=True).contiguous()
        return kernels.window_scores(
            q,
            keys,
            query_positions=positions.to(self.device, non_blocking=True),
            scale=self.scale,
        )

    def warm_up(
        self,
        policy: CompactionPolicy,
        query_heads: int,
        window: int,
        max_tokens: int,
        budget: float,
    ) -> list[tuple[int, float]]:
        """Compile and autotune every kernel the packs of this engine will use.

        The window-score kernels tune once per power-of-two length from
        ``TUNE_MIN_TOKENS``; one pack per such length up to ``max_tokens`` (and one short
        one) covers every shape a request can bring. Packs garbage blocks of a pool that
        holds no request yet.

        Returns:
            ``(tokens, seconds)`` per warm-up pack.
        """
        from lmcompact.kernels.window_scores import warm_up_lengths

        bs = self.block_size
        capacity = (self.kv_layers[0].shape[0] - 1) * bs  # block 0 is vLLM's null block
        lengths = warm_up_lengths(min(max_tokens, capacity))
        done: list[tuple[int, float]] = []
        two_d = self.kv_layers[0].shape[-1]
        for tokens in dict.fromkeys(t // bs * bs for t in lengths if t >= 2 * bs):
            kept = max(bs, int(tokens * budget) // bs * bs)
            if kept >= tokens:
                continue
            queries = positions = None
            if policy.needs & SCORE_NEEDS:
                gen = torch.Generator(device=self.device).manual_seed(tokens)
                queries = torch.randn(
                    len(self.kv_layers),
                    query_heads,
                    window,
                    two_d // 2,
                    device=self.device,
                    generator=gen,
                ).to(self.score_dtype)
                positions = torch.arange(tokens - window, tokens, device=self.device)
            began = time.perf_counter()
            row = range(1, tokens // bs + 1)
            if isinstance(policy, AdaKV | PyramidKV):  # per-head: cells as wide as the mean
                self.pack_per_head(row, tokens, kept, kept, None, policy, queries, positions)
            else:
                self.pack(row, tokens, kept, policy, queries, positions)
            torch.cuda.synchronize(self.device)
            done.append((tokens, time.perf_counter() - began))
        logger.info("device pack warm-up (tokens, s): %s", done)
        return done
