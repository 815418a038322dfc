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
        """Check shapes and ``0 <= kept <= tail_start <= seq_len <= max_slots``.

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
        if bool((kept < 0).any()) or bool((kept > start[:, None]).any()):
            raise ValueError("need 0 <= kept[b, h] <= tail_start[b] for every head")
        if bool((start > end).any()) or bool((end > max_slots).any()):
            raise ValueError(
                f"need tail_start <= seq_len <= {max_slots} (block table width x block_size)"
            )
        if bool((start % block_size != 0).any()):
            raise ValueError(f"tail_start must be a multiple of block_size {block_size}")


def slot_addresses(
    table: torch.Tensor, slots: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical ``(block, offset)`` of slots of one request; ``table`` is ``(max_blocks,)``."""
    return table[slots // block_size].long(), slots % block_size
