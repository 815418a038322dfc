"""One :class:`TieredStore` per (namespace, store config) and process, reference-counted.

When an engine's scheduler and worker run in one process (vLLM's in-process engine core),
both connector halves must see the same CPU tier: the scheduler answers lookups from what
the worker stored. Across processes only shared tiers (Redis) are shared.
"""

from __future__ import annotations

import json
import logging
import threading

from lmcompact.store.keys import StoreNamespace
from lmcompact.store.tiered import StoreConfig, TieredStore

logger = logging.getLogger(__name__)


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
