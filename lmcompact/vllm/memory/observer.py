"""What the worker's page-reading after-attention observers share.

Per-head attention recompute (:mod:`lmcompact.vllm.memory.perhead_attention`) and H2O key-mass
scoring (:mod:`lmcompact.vllm.memory.heavy_hitters`) both run after vLLM's attention kernel, read a
request's pages of the current layer, and need the same per-step view of the batch: which batch
rows belong to the requests they track. Every layer of a step shares one metadata object, so
those rows are built once, at the step's first layer, and cached by that object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import torch

from lmcompact.vllm.kv_layout import PageLayout

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


def worker_pages(worker: Any) -> dict[str, Any]:
    """:class:`PageObserver` arguments of a :class:`lmcompact.vllm.worker_side.WorkerHalf` whose
    KV caches are registered."""
    return {
        "layout": worker.layout,
        "kv_caches": worker.kv_caches,
        "layer_index": worker.layer_index,
        "scales": {name: float(layer.impl.scale) for name, layer in worker.layers.items()},
        "head_dim": worker.facts.head_dim,
    }
