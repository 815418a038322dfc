from __future__ import annotations

import threading

import pytest
import torch

from lmcompact.store import (
    CPUTier,
    FIFOPolicy,
    GPUTier,
    LRUPolicy,
    PinTable,
    StoreConfig,
    TieredStore,
    chunk_keys,
)
from lmcompact.store.eviction import make_eviction_policy
from lmcompact.store.tiers.memory import MemoryTier
from tests.unit.store.store_helpers import make_chunk, make_namespace, same_chunk

NS = make_namespace()
KEYS = chunk_keys(list(range(256 * 40)), NS, 256)
CHUNK_BYTES = make_chunk(0).payload_nbytes


def tier(n_chunks: int, **kw) -> MemoryTier:
    return CPUTier(n_chunks * CHUNK_BYTES, pin_memory=False, **kw)


def test_put_get_copies_and_counts():
    t = tier(4)
    src = make_chunk(0)
    assert t.put(KEYS[0], src)
    got = t.get(KEYS[0])
    assert got is not None and same_chunk(got, src)
    assert got.keys.data_ptr() != src.keys.data_ptr()  # the tier owns a copy
    src.keys.zero_()
    assert not same_chunk(got, src)
    assert t.get(KEYS[1]) is None
    m = t.metrics()
    assert (m["hits"], m["misses"], m["puts"]) == (1, 1, 1)
    assert m["bytes_in"] == m["bytes_out"] == CHUNK_BYTES == m["used_bytes"]


def test_lru_order_and_capacity():
    t = tier(3)
    for i in range(3):
        assert t.put(KEYS[i], make_chunk(i))
    assert t.get(KEYS[0]) is not None  # 0 is now most recent; 1 is the LRU
    assert t.put(KEYS[3], make_chunk(3))
    assert not t.contains(KEYS[1])
    assert [t.contains(KEYS[i]) for i in (0, 2, 3)] == [True, True, True]
    assert t.keys() == [KEYS[2], KEYS[0], KEYS[3]]
    assert t.metrics()["evictions"] == 1
    for i in range(4, 20):
        t.put(KEYS[i], make_chunk(i))
        assert t.used_bytes <= t.capacity_bytes
        assert t.metrics()["allocated_bytes"] <= t.capacity_bytes
    assert len(t) == 3 and t.metrics()["evictions"] == 17
    assert same_chunk(t.get(KEYS[19]), make_chunk(19))


def test_fifo_ignores_reads():
    t = tier(2, eviction="fifo")
    t.put(KEYS[0], make_chunk(0))
    t.put(KEYS[1], make_chunk(1))
    t.get(KEYS[0])
    t.put(KEYS[2], make_chunk(2))
    assert not t.contains(KEYS[0]) and t.contains(KEYS[1])


def test_too_large_and_mixed_sizes():
    t = tier(2)
    assert not t.put(KEYS[0], make_chunk(0, kept=64))
    assert t.metrics()["put_failures"] == 1 and len(t) == 0
    t.put(KEYS[1], make_chunk(1))
    t.put(KEYS[2], make_chunk(2, kept=4))  # half size
    assert t.put(KEYS[3], make_chunk(3, kept=12))  # 1.5 chunks: evicts KEYS[1]
    assert not t.contains(KEYS[1]) and t.used_bytes <= t.capacity_bytes


def test_pinned_entries_are_never_evicted():
    t = tier(2)
    t.put(KEYS[0], make_chunk(0))
    t.put(KEYS[1], make_chunk(1))
    assert t.pin(KEYS[0]) and t.pin(KEYS[0])
    assert not t.pin(KEYS[9])  # absent: nothing pinned
    t.put(KEYS[2], make_chunk(2))  # evicts 1 (0 is LRU but pinned)
    assert t.contains(KEYS[0]) and not t.contains(KEYS[1])
    assert t.pin(KEYS[2])
    assert not t.put(KEYS[3], make_chunk(3))  # everything pinned: refused, nothing evicted
    assert t.contains(KEYS[0]) and t.contains(KEYS[2])
    assert not t.delete(KEYS[0])  # pinned entries cannot be deleted either
    t.unpin(KEYS[0])
    assert t.pin_count(KEYS[0]) == 1
    t.unpin(KEYS[0])
    with pytest.raises(RuntimeError, match="not pinned"):
        t.unpin(KEYS[0])
    assert t.put(KEYS[3], make_chunk(3))
    assert not t.contains(KEYS[0]) and t.contains(KEYS[2])


def test_pin_table_never_clamps():
    pins = PinTable()
    with pytest.raises(RuntimeError):
        pins.unpin("a")
    pins.pin("a")
    pins.unpin("a")
    with pytest.raises(RuntimeError):
        pins.unpin("a")
    assert pins.count("a") == 0


def test_recycled_buffer_never_overwrites_a_held_chunk():
    t = tier(1)
    t.put(KEYS[0], make_chunk(0))
    held = t.get(KEYS[0])
    t.put(KEYS[1], make_chunk(1))  # evicts 0; its buffer is still viewed by `held`
    assert same_chunk(held, make_chunk(0))
    del held
    t.put(KEYS[2], make_chunk(2))  # now 1's buffer may be recycled
    assert same_chunk(t.get(KEYS[2]), make_chunk(2))
    assert t.metrics()["allocated_bytes"] <= t.capacity_bytes


def test_gpu_tier_falls_back_to_cpu_device():
    t = GPUTier(4 * CHUNK_BYTES, device=None if torch.cuda.is_available() else "cpu")
    t.put(KEYS[0], make_chunk(0))
    assert t.get(KEYS[0]).device == t.device


def test_eviction_policy_names():
    assert isinstance(make_eviction_policy("lru"), LRUPolicy)
    assert isinstance(make_eviction_policy("lmcompact.store.eviction:FIFOPolicy"), FIFOPolicy)
    with pytest.raises(ValueError, match="allowed"):
        make_eviction_policy("random")
    with pytest.raises(ValueError, match="not an EvictionPolicy"):
        make_eviction_policy("lmcompact.store.eviction:PinTable")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_capacity_bytes", 0),
        ("gpu_capacity_bytes", -5),
        ("redis_url", "http://localhost"),
        ("eviction", "random"),
        ("redis_queue_size", 0),
        ("redis_backoff_initial_s", 100.0),
        ("redis_ttl_s", 0),
        ("metrics_log_interval_s", -1.0),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        StoreConfig(**{field: value})


def test_config_needs_a_tier():
    with pytest.raises(ValueError, match="at least one tier"):
        StoreConfig(cpu_capacity_bytes=None)


def test_store_promotes_hits_upward():
    cfg = StoreConfig(
        gpu_capacity_bytes=2 * CHUNK_BYTES, gpu_device="cpu", cpu_capacity_bytes=8 * CHUNK_BYTES
    )
    with TieredStore(NS, cfg) as store:
        gpu, cpu = store.tier("gpu"), store.tier("cpu")
        for i in range(4):
            assert store.put(KEYS[i], make_chunk(i))
        assert [gpu.contains(k) for k in KEYS[:4]] == [False, False, True, True]
        assert all(cpu.contains(k) for k in KEYS[:4])
        got = store.get_many(KEYS[:5])
        assert [g is not None for g in got] == [True] * 4 + [False]
        assert all(same_chunk(got[i], make_chunk(i)) for i in range(4))
        assert gpu.contains(KEYS[0]) or gpu.contains(KEYS[1])  # promoted
        m = store.metrics()
        assert m["gpu"]["hits"] == 2 and m["cpu"]["hits"] == 2
        assert m["cpu"]["misses"] == 1


def test_store_pin_token_and_double_unpin():
    cfg = StoreConfig(cpu_capacity_bytes=2 * CHUNK_BYTES)
    store = TieredStore(NS, cfg)
    store.put(KEYS[0], make_chunk(0))
    token = store.pin(KEYS[:2])
    assert token == [(0, KEYS[0])]
    store.unpin(token)
    with pytest.raises(RuntimeError):
        store.unpin(token)


def test_concurrent_memory_tier():
    t = tier(6)
    errors: list[str] = []

    def work(tid: int) -> None:
        for i in range(30):
            k = KEYS[(tid * 7 + i) % len(KEYS)]
            seed = (tid * 7 + i) % len(KEYS)
            t.put(k, make_chunk(seed))
            got = t.get(k)
            if got is not None and not same_chunk(got, make_chunk(seed)):
                errors.append(f"mixed up {seed}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert t.used_bytes <= t.capacity_bytes


def test_host_only_puts_take_no_stream_copy():
    """Without a host <-> CUDA crossing the memory tiers copy synchronously, as before."""
    from lmcompact.store.transfer import CopierPool, needs_stream_copy

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not needs_stream_copy(cpu, cpu) and not needs_stream_copy(cuda, cuda)
    assert needs_stream_copy(cpu, cuda) and needs_stream_copy(cuda, cpu)
    assert CopierPool().for_copy(cpu, cpu) is None
    tier = CPUTier(1 << 20, pin_memory=False)
    assert tier.put(KEYS[0], make_chunk(0))
    got = tier.get(KEYS[0])
    assert got is not None and same_chunk(got, make_chunk(0))
    assert len(tier._copiers) == 0 and not tier._inflight


def test_packed_span_views_a_packed_payload_only():
    from lmcompact.store.chunk import packed_span

    loose = make_chunk(0)  # from_dense: positions, keys, values in three allocations
    assert packed_span(loose) is None
    packed = loose.clone()  # one buffer, positions | keys | values
    span = packed_span(packed)
    assert span is not None and span.dtype == torch.uint8
    assert span.numel() == packed.payload_nbytes and span.data_ptr() == packed.positions.data_ptr()
    buf = torch.empty(packed.payload_nbytes, dtype=torch.uint8)
    assert same_chunk(loose.pack_into(buf), packed) and torch.equal(buf, span)
