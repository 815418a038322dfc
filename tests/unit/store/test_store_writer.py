from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from lmcompact.store import CompactedChunk, CPUTier, StoreConfig, TieredStore, chunk_keys
from lmcompact.store.keys import ChunkKey
from tests.unit.store.store_helpers import make_chunk, make_namespace, same_chunk

NS = make_namespace()
KEYS = chunk_keys(list(range(256 * 10)), NS, 256)
SIZE = make_chunk(0).payload_nbytes


class GatedTier(CPUTier):
    """A real memory tier named like the slow one, whose writes wait for a gate."""

    name = "redis"

    def __init__(self) -> None:
        super().__init__(100 * SIZE, pin_memory=False)
        self.name = "redis"
        self.gate = threading.Event()

    def put_many(self, items: Sequence[tuple[ChunkKey, CompactedChunk]]) -> list[bool]:
        self.gate.wait(10)
        return super().put_many(items)


def test_back_pressure_drops_and_counts_without_blocking_long():
    slow = GatedTier()
    cfg = StoreConfig(cpu_capacity_bytes=100 * SIZE, redis_queue_size=2, redis_queue_timeout_s=0.05)
    store = TieredStore(NS, cfg, tiers=[CPUTier(100 * SIZE, pin_memory=False), slow])
    start = time.monotonic()
    results = [store.put(KEYS[i], make_chunk(i)) for i in range(8)]
    elapsed = time.monotonic() - start
    assert all(results)  # the CPU tier took every chunk
    assert elapsed < 8 * 0.05 + 1.0
    dropped = store.metrics()["writers"]["redis"]["dropped"]
    assert dropped >= 1
    slow.gate.set()
    assert store.flush(5)
    w = store.metrics()["writers"]["redis"]
    assert w["written"] + w["dropped"] == 8 and w["failed"] == 0
    store.close()


def test_background_write_uses_the_stores_copy():
    slow = GatedTier()
    store = TieredStore(NS, StoreConfig(), tiers=[CPUTier(100 * SIZE, pin_memory=False), slow])
    src = make_chunk(3)
    store.put(KEYS[0], src)
    src.keys.zero_()  # caller reuses its buffer before the write-behind ran
    slow.gate.set()
    store.flush(5)
    assert same_chunk(slow.get(KEYS[0]), make_chunk(3))
    store.close()
