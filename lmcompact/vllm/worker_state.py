"""What the parts of a worker half share: :class:`WorkerState` declares it once.

:class:`lmcompact.vllm.worker_side.WorkerHalf` sets these in its constructor and owns the
accessors; its parts (:mod:`worker_load`, :mod:`worker_save`, :mod:`worker_tables`) read
them through this base, so the type checker sees one declaration.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from lmcompact.store import ChunkKey, TieredStore
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.kv_layout import PageLayout
from lmcompact.vllm.memory.perhead_attention import PerHeadAttention
from lmcompact.vllm.metadata import WorkerReport


class WorkerState:
    """Attributes and accessors of the worker half that its parts use."""

    config: ConnectorConfig
    facts: shim.EngineFacts
    vllm_config: Any
    store: TieredStore
    layout: PageLayout
    kept: int
    cap: int | None  # store.per_head: most rows per (layer, head) of a stored chunk
    slots: int  # slots one loaded chunk takes in a block row (kept, or the cap)
    perhead: PerHeadAttention | None  # store.per_head: masks each head's padding
    kv_caches: dict[str, torch.Tensor]
    layers: dict[str, Any]
    layer_index: dict[str, int]
    stats: dict[str, float]
    _lock: threading.Lock
    _report: WorkerReport

    # defined by WorkerHalf (declared here for the type checker; never reached)
    def slice_keys(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        raise NotImplementedError

    def window_queries(self, req_id: str) -> tuple[list[torch.Tensor], list[int]] | None:
        raise NotImplementedError

    def forget_window(self, req_id: str) -> None:
        raise NotImplementedError

    @property
    def sliding_layers(self) -> frozenset[int]:
        raise NotImplementedError
