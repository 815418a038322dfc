"""K/V storage of a block pool: float, or int8 with per-(head, token) scales.

Physical layout is head-major so that a run of consecutive blocks of one head
is one contiguous ``(n * block_size, head_dim)`` matrix (attention reads it as
a view, no gather)::

    keys    (Hkv, num_blocks, block_size, D)      float or int8
    values  (Hkv, num_blocks, block_size, D)
    scales  (Hkv, num_blocks, block_size)          float32, int8 storage only

    head 0: [blk 0: t0..t63][blk 1: t64..][blk 2 ...] ...
    head 1: [blk 0: t0..t63][blk 1: t64..][blk 2 ...] ...

:meth:`KVStorage.paged_views` exposes the logical view
``(num_blocks, block_size, Hkv, D)`` of :mod:`lmcompact.layout.paged` (for the
Triton kernels). Tensors are made with ``torch.empty``: on CPU, pages of blocks
never written are not touched. Host index tensors go to the device with
``non_blocking=True``: from pageable memory the bytes are staged at once and
the call returns without the stream sync of a blocking copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmcompact.hf.paged.quant import dequantize_int8, quantize_int8

KV_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class StorageSpec:
    """Shape and element type of a pool's storage.

    Attributes:
        num_blocks: Blocks in the pool.
        block_size: Token slots per block.
        num_kv_heads: Hkv.
        head_dim: D.
        dtype: Compute dtype (what attention returns and what ``auto`` stores).
        kv_dtype: ``"auto"`` (store ``dtype``) or ``"int8"``.
    """

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == "int8"

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block (scales included)."""
        values = self.block_size * self.num_kv_heads * self.head_dim
        if self.quantized:
            return 2 * (values + self.block_size * self.num_kv_heads * 4)
        return 2 * values * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class KVRun:
    """Keys and values of some blocks laid end to end, per head.

    Attributes:
        keys, values: ``(Hkv, L, D)`` raw storage (int8 when quantized).
        key_scales, value_scales: ``(Hkv, L)`` float32, or None (float storage).
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None


class KVStorage:
    """The K/V tensors behind a :class:`~lmcompact.hf.paged.blocks.BlockPool`.

    Token addresses are ``(block, offset)`` pairs; every write covers all heads
    of a token, moves may address single heads.
    """

    def __init__(self, spec: StorageSpec, device: torch.device | str) -> None:
        self.spec = spec
        shape = (spec.num_kv_heads, spec.num_blocks, spec.block_size, spec.head_dim)
        store = torch.int8 if spec.quantized else spec.dtype
        self.keys = torch.empty(shape, dtype=store, device=device)
        self.values = torch.empty(shape, dtype=store, device=device)
        self.key_scales: torch.Tensor | None = None
        self.value_scales: torch.Tensor | None = None
        if spec.quantized:
            self.key_scales = torch.empty(shape[:3], dtype=torch.float32, device=device)
            self.value_scales = torch.empty(shape[:3], dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.keys.device

    # ------------------------------------------------------------------ writes
    def write(
        self,
        blocks: torch.Tensor,
        offsets: torch.Tensor | int,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Store ``n`` tokens (all heads).

        Args:
            blocks: ``(n,)`` block ids; offsets: ``(n,)`` slots inside those
                blocks, or one slot for all (a decode step).
            keys, values: ``(Hkv, n, D)`` in the compute dtype.
        """
        if keys.shape != values.shape or keys.shape[1] != blocks.shape[0]:
            raise ValueError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must be "
                f"(Hkv, n={blocks.shape[0]}, D)"
            )
        blocks = self._here(blocks)
        if isinstance(offsets, torch.Tensor):
            offsets = self._here(offsets)
        if self.key_scales is None or self.value_scales is None:
            self.keys[:, blocks, offsets] = keys.to(self.keys.dtype)
            self.values[:, blocks, offsets] = values.to(self.values.dtype)
            return
        qk, sk = quantize_int8(keys)
        qv, sv = quantize_int8(values)
        self.keys[:, blocks, offsets] = qk
        self.values[:, blocks, offsets] = qv
        self.key_scales[:, blocks, offsets] = sk
        self.value_scales[:, blocks, offsets] = sv

    def clear(self, blocks: torch.Tensor) -> None:
        """Zero whole blocks (new blocks: attention multiplies unused slots by zero
        probabilities, so they must hold finite values, never ``torch.empty`` garbage)."""
        blocks = self._here(blocks)
        for tensor in self._tensors():
            tensor[:, blocks] = 0

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, upto: int) -> None:
        """Copy slots ``[0, upto)`` of blocks ``src`` into blocks ``dst`` (raw, exact)."""
        src, dst = self._here(src), self._here(dst)
        for tensor in self._tensors():
            if upto == self.spec.block_size:  # whole blocks: index ops beat slicing setitem
                tensor.index_copy_(1, dst, tensor.index_select(1, src))
            else:
                tensor[:, dst, :upto] = tensor[:, src, :upto]

    def move_tokens(
        self,
        heads: torch.Tensor,
        src: tuple[torch.Tensor, torch.Tensor],
        dst: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Move single-head tokens: every source is read before any destination is written.

        Args:
            heads: ``(n,)`` kv head of each move.
            src: ``(blocks, offsets)``, each ``(n,)``; dst: likewise.
        """
        heads = self._here(heads)
        sb, so = (self._here(t) for t in src)
        db, do = (self._here(t) for t in dst)
        for tensor in self._tensors():
            moved = tensor[heads, sb, so].clone()
            tensor[heads, db, do] = moved

    # ------------------------------------------------------------------- reads
    def read_tokens(
        self, heads: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of single-head tokens, each ``(n, D)``."""
        heads, blocks, offsets = (self._here(t) for t in (heads, blocks, offsets))
        k, v = self.keys[heads, blocks, offsets], self.values[heads, blocks, offsets]
        if self.key_scales is None or self.value_scales is None:
            return k, v
        dtype = self.spec.dtype
        return (
            dequantize_int8(k, self.key_scales[heads, blocks, offsets], dtype),
            dequantize_int8(v, self.value_scales[heads, blocks, offsets], dtype),
        )

    def read_slots(
        self, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of tokens (all heads), each ``(Hkv, n, D)``."""
        blocks, offsets = self._here(blocks), self._here(offsets)
        k, v = self.keys[:, blocks, offsets], self.values[:, blocks, offsets]
        if self.key_scales is None or self.value_scales is None:
            return k, v
        dtype = self.spec.dtype
        return (
            dequantize_int8(k, self.key_scales[:, blocks, offsets], dtype),
            dequantize_int8(v, self.value_scales[:, blocks, offsets], dtype),
        )

    def block_run(self, start: int, end: int) -> KVRun:
        """Blocks ``[start, end)`` as ``(Hkv, (end - start) * block_size, ...)`` views (no copy)."""
        return self._run(lambda t: t[:, start:end])

    def block_gather(self, ids: torch.Tensor) -> KVRun:
        """Blocks ``ids`` (any order) gathered into a run (a copy)."""
        ids = self._here(ids)
        return self._run(lambda t: t.index_select(1, ids))

    def _run(self, pick: Callable[[torch.Tensor], torch.Tensor]) -> KVRun:
        h = self.spec.num_kv_heads
        k, v = pick(self.keys), pick(self.values)
        length = k.shape[1] * k.shape[2]
        ks = vs = None
        if self.key_scales is not None and self.value_scales is not None:
            ks = pick(self.key_scales).reshape(h, length)
            vs = pick(self.value_scales).reshape(h, length)
        return KVRun(k.reshape(h, length, -1), v.reshape(h, length, -1), ks, vs)

    def paged_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(num_blocks, block_size, Hkv, D)`` views of K and V (no copy)."""
        return self.keys.permute(1, 2, 0, 3), self.values.permute(1, 2, 0, 3)

    def paged_scale_views(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(num_blocks, block_size, Hkv)`` views of the int8 scales, None for float storage."""
        if self.key_scales is None or self.value_scales is None:
            return None
        return self.key_scales.permute(1, 2, 0), self.value_scales.permute(1, 2, 0)

    def _here(self, index: torch.Tensor) -> torch.Tensor:
        """An index tensor on the storage's device (no stream sync: see the module docstring)."""
        return index.to(self.device, non_blocking=True)

    def _tensors(self) -> list[torch.Tensor]:
        out = [self.keys, self.values]
        if self.key_scales is not None and self.value_scales is not None:
            out += [self.key_scales, self.value_scales]
        return out
