"""Paged KV pools with per-(request, kv_head) lengths and the block-aligned hole.

A paged pool is seen through one logical view per tensor (K and V)::

    pool[block, slot_in_block, kv_head, dim]        (num_blocks, block_size, Hkv, D)

with any strides, as long as ``dim`` is contiguous. Both GPU layouts in use fit:

    vLLM 0.26 GPU cache  kv (num_blocks, Hkv, block_size, 2*D), K | V in the last dim
        -> K = kv[..., :D].transpose(1, 2),  V = kv[..., D:].transpose(1, 2)
    flash-attn layout    kv (2, num_blocks, block_size, Hkv, D)
        -> K = kv[0],  V = kv[1]

A request's block table maps its slot ``j`` to ``pool[table[j // bs], j % bs]``.
After compaction (design notes, section 4) the slots of request ``b`` and kv
head ``h`` are::

    slot  0            kept[b, h]        tail_start[b]            seq_len[b]
          [ kept tokens  |  hole (skipped)  |  uncompacted tail tokens  ]
          visible to every query            causal: slot <= query slot

Kept tokens are packed at the front of the request's slots, one count per
head; the hole's blocks may already be back in the pool (their table entries
are never read); the tail starts at a block boundary and holds the tokens
computed since. The ``q_len[b]`` queries of request ``b`` are the last tail
tokens: query ``i`` sits at slot ``seq_len[b] - q_len[b] + i`` (bottom-right
aligned causal mask). A request that was never compacted has
``kept = tail_start = 0``.

Dense per-head cells (``dense_start`` / ``dense_base`` set): the kept keys of head ``h`` past
the first ``dense_base[b]`` slots (which every head keeps in the normal layout, e.g. vLLM's own
prefix-cache hits) are not at their slots but in *cells*: a block of ``bs`` slots x ``Hkv``
heads is ``bs x Hkv`` cells, numbered over the request's row as::

    cell c  ->  block table[c // (bs * Hkv)], head (c % (bs * Hkv)) // bs, slot c % bs

Head ``h``'s dense keys are cells ``[dense_start[b, h], dense_start[b, h] + kept[b, h] -
dense_base[b])``, heads one after another, so a request holds ``sum_h`` of its counts in
cells instead of ``max_h`` of them in slots (:func:`dense_cells`). Within a block the cells
of one head are its ``bs`` slots, contiguous in vLLM 0.26's ``(num_blocks, Hkv, bs, 2*D)``
GPU cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def vllm_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``(num_blocks, block_size, Hkv, D)`` of a vLLM 0.26 GPU cache.

    Args:
        kv_cache: ``(num_blocks, Hkv, block_size, 2 * D)``, token-major, K then V
            in the last dimension (no copy is made).
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(
            "a vLLM 0.26 GPU cache must be (num_blocks, num_kv_heads, block_size, 2*head_dim); "
            f"got {tuple(kv_cache.shape)}"
        )
    d = kv_cache.shape[-1] // 2
    return kv_cache[..., :d].transpose(1, 2), kv_cache[..., d:].transpose(1, 2)


def check_pool(keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a K/V pool pair; return ``(num_blocks, block_size, Hkv, D)``.

    Raises:
        ValueError: when shapes differ, the rank is not 4, ``dim`` is not contiguous,
            K and V strides differ, or the dtypes differ.
    """
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(
            "key and value pools must both be (num_blocks, block_size, num_kv_heads, head_dim); "
            f"got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError(
            f"head_dim must be contiguous (stride 1); got strides {keys.stride()} and "
            f"{values.stride()}"
        )
    if keys.stride() != values.stride():
        raise ValueError(
            f"key and value pools must share strides; got {keys.stride()} and {values.stride()}"
        )
    if keys.dtype != values.dtype:
        raise ValueError(f"key and value dtypes differ: {keys.dtype} and {values.dtype}")
    nb, bs, h, d = keys.shape
    return nb, bs, h, d


@dataclass(frozen=True)
class PagedLengths:
    """Per-(request, kv_head) slot ranges of a compacted paged batch.

    Attributes:
        kept: ``(B, Hkv)`` int kept tokens per head, packed in slots ``[0, kept)``.
        tail_start: ``(B,)`` int first slot of the uncompacted tail (``>= kept``).
        seq_len: ``(B,)`` int slots in use (the tail is ``[tail_start, seq_len)``).
    """

    kept: torch.Tensor
    tail_start: torch.Tensor
    seq_len: torch.Tensor
    dense_start: torch.Tensor | None = None
    dense_base: torch.Tensor | None = None

    @property
    def dense(self) -> bool:
        """Kept keys past ``dense_base`` live in per-head cells (module docstring)."""
        return self.dense_start is not None

    @classmethod
    def uncompacted(cls, seq_len: torch.Tensor, num_kv_heads: int) -> PagedLengths:
        """Lengths of requests that were never compacted: everything is tail."""
        zeros = torch.zeros_like(seq_len)
        return cls(zeros[:, None].expand(-1, num_kv_heads).contiguous(), zeros, seq_len)

    @property
    def batch_size(self) -> int:
        return int(self.seq_len.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.kept.shape[1])

    def visible(self) -> torch.Tensor:
        """``(B, Hkv)`` keys the last query of each request sees."""
        return self.kept + (self.seq_len - self.tail_start)[:, None]

    def validate(self, num_kv_heads: int, max_slots: int, block_size: int) -> None:
        """Check shapes and ``0 <= kept <= tail_start <= seq_len <= max_slots`` (dense cells:
        every head's cells between the ``dense_base`` blocks and the tail).

        This reads the tensors on the host (a device sync on GPU): call it where
        lengths enter, not per layer.
        """
        b = self.batch_size
        if self.kept.shape != (b, num_kv_heads):
            raise ValueError(f"kept must be ({b}, {num_kv_heads}), got {tuple(self.kept.shape)}")
        if self.tail_start.shape != (b,) or self.seq_len.shape != (b,):
            raise ValueError(
                f"tail_start and seq_len must be ({b},); got {tuple(self.tail_start.shape)} "
                f"and {tuple(self.seq_len.shape)}"
            )
        for name, t in (
            ("kept", self.kept),
            ("tail_start", self.tail_start),
            ("seq_len", self.seq_len),
        ):
            if t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        kept, start, end = self.kept.cpu(), self.tail_start.cpu(), self.seq_len.cpu()
        if bool((kept < 0).any()) or (not self.dense and bool((kept > start[:, None]).any())):
            raise ValueError("need 0 <= kept[b, h] <= tail_start[b] for every head")
        if bool((start > end).any()) or bool((end > max_slots).any()):
            raise ValueError(
                f"need tail_start <= seq_len <= {max_slots} (block table width x block_size)"
            )
        if bool((start % block_size != 0).any()):
            raise ValueError(f"tail_start must be a multiple of block_size {block_size}")
        if self.dense_start is not None or self.dense_base is not None:
            self._validate_dense(kept, start, num_kv_heads, block_size)

    def _validate_dense(
        self, kept: torch.Tensor, start: torch.Tensor, num_kv_heads: int, block_size: int
    ) -> None:
        if self.dense_start is None or self.dense_base is None:
            raise ValueError("dense_start and dense_base go together")
        b = self.batch_size
        if self.dense_start.shape != (b, num_kv_heads) or self.dense_base.shape != (b,):
            raise ValueError(
                f"dense_start must be ({b}, {num_kv_heads}) and dense_base ({b},); got "
                f"{tuple(self.dense_start.shape)} and {tuple(self.dense_base.shape)}"
            )
        first, base = self.dense_start.cpu().long(), self.dense_base.cpu().long()
        if bool((base % block_size != 0).any()) or bool((base[:, None] > kept).any()):
            raise ValueError("need a block-aligned dense_base[b] <= kept[b, h]")
        if bool((first < (base * num_kv_heads)[:, None]).any()) or bool(
            (first + kept - base[:, None] > (start * num_kv_heads)[:, None]).any()
        ):
            raise ValueError(
                "every head's dense cells must lie after the dense_base slots' blocks and "
                "before the tail's first block"
            )


def dense_cells(counts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """Where heads' dense cells start, one head after another, and the blocks they fill.

    Args:
        counts: ``(L, Hkv)`` dense keys per (layer, head).
        block_size: slots per block.

    Returns:
        ``(L, Hkv)`` int64 first cell of every head (relative to the dense region's first
        block) and the blocks the largest layer fills: ``max_l ceil(sum_h counts / (bs*Hkv))``.
    """
    counts = counts.to(torch.int64)
    starts = torch.cumsum(counts, dim=1) - counts
    cells = block_size * counts.shape[1]
    blocks = int((-(-counts.sum(dim=1) // cells)).max()) if counts.numel() else 0
    return starts, blocks


def cell_addresses(
    table: torch.Tensor, cells: torch.Tensor, block_size: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Physical ``(block, slot, head)`` of one request's dense cells; ``table`` is its row."""
    per_block = block_size * num_kv_heads
    within = cells % per_block
    return table[cells // per_block].long(), within % block_size, within // block_size


def slot_addresses(
    table: torch.Tensor, slots: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical ``(block, offset)`` of slots of one request; ``table`` is ``(max_blocks,)``."""
    return table[slots // block_size].long(), slots % block_size
