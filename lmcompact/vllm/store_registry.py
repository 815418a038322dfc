"""One :class:`TieredStore` per (namespace, store config) and process, shared by both halves.

When the scheduler and the worker run in one process (vLLM's in-process engine core with
the ``uni`` executor, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), both halves must see the same
CPU tier: the scheduler half answers lookups from what the worker half stored. Across
processes only the Redis tier is shared (the CPU tier then serves the worker alone).

:func:`build_namespace` names what one tensor-parallel rank's store holds (model, dtype,
page-independent row layout, policy).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING

from lmcompact.store import StoreConfig, StoreNamespace, TieredStore

if TYPE_CHECKING:
    from lmcompact.vllm import vllm_shim as shim
    from lmcompact.vllm.config import ConnectorConfig

logger = logging.getLogger(__name__)

STORE_LAYOUT = "lmcompact-rows-v1"
"""Stored chunks are per-head rows, independent of any engine page layout."""


def build_namespace(
    config: ConnectorConfig, facts: shim.EngineFacts, tp_rank: int = 0
) -> StoreNamespace:
    """The store namespace of ``tp_rank``'s slices (rank 0's also derives the chunk keys)."""
    params = config.namespace_params()
    if config.store_compacts and facts.sliding_window is not None:
        # sliding-window layers store each chunk's most recent rows (lmcompact/vllm/holes.py);
        # chunks stored before that must not load as if they did
        params["sliding_rows"] = "recent"
    return StoreNamespace(
        model_id=config.store.model_id or facts.model_id,
        kv_dtype=str(facts.dtype).removeprefix("torch."),
        kv_layout=STORE_LAYOUT,
        tp_rank=tp_rank,
        tp_world_size=facts.tp_size,
        policy_name=config.store_policy_name,
        policy_params=params,
    )


class StoreRegistry:
    """Reference-counted stores; the last :meth:`release` closes one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stores: dict[str, tuple[TieredStore, int]] = {}

    @staticmethod
    def _key(namespace: StoreNamespace, config: StoreConfig) -> str:
        return namespace.digest().hex() + json.dumps(config.to_dict(), sort_keys=True, default=str)

    def acquire(self, namespace: StoreNamespace, config: StoreConfig) -> TieredStore:
        key = self._key(namespace, config)
        with self._lock:
            store, refs = self._stores.get(key, (None, 0))
            if store is None:
                store = TieredStore(namespace, config)
                logger.info("opened store with tiers %s", [t.name for t in store.tiers])
            self._stores[key] = (store, refs + 1)
            return store

    def release(self, store: TieredStore) -> None:
        with self._lock:
            for key, (held, refs) in list(self._stores.items()):
                if held is store:
                    if refs <= 1:
                        del self._stores[key]
                        held.close()
                    else:
                        self._stores[key] = (held, refs - 1)
                    return


STORES = StoreRegistry()
"""The process's stores (shared configuration objects, not per-step state)."""
