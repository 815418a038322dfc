"""Store tiers across host and CUDA: side-stream copies, events, no stall of the caller's
stream (skipped without a GPU)."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from lmcompact.store import CompactedChunk, StoreConfig, TieredStore, chunk_keys
from lmcompact.store.tiers.cpu_tier import CPUTier
from lmcompact.store.tiers.gpu_tier import GPUTier
from lmcompact.store.transfer import StreamCopier
from tests.unit.store.store_helpers import make_chunk, make_namespace, same_chunk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NS = make_namespace()
KEYS = chunk_keys(list(range(256 * 8)), NS, 256)
PRODUCER_S = 0.5  # how long the simulated producer keeps the GPU busy


@functools.cache
def sleep_cycles(seconds: float = PRODUCER_S) -> int:
    """``torch.cuda._sleep`` cycles that keep this GPU busy for about ``seconds`` (measured:
    a fixed count was 0.1 s on paper and under 0.05 s on the H200)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds / max(start.elapsed_time(end) / 1000, 1e-6))


def device_chunk(seed: int, fill: float | None = None, kept: int = 64) -> CompactedChunk:
    """A chunk on CUDA; with ``fill``, its K/V are written by a kernel queued after a long
    sleep on the current stream (so a copy that does not wait for that stream reads
    stale bytes)."""
    chunk = make_chunk(seed, layers=4, heads=2, kept=kept, dim=64, dtype=torch.bfloat16)
    dev = chunk.clone("cuda")
    if fill is not None:
        # the first launch of a kernel loads its module, which waits for the whole device
        # (CUDA lazy loading): run the fill once before the producer's sleep
        dev.keys.fill_(0.0)
        dev.values.fill_(0.0)
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles())
        dev.keys.fill_(fill)
        dev.values.fill_(-fill)
    return dev


def test_save_to_pinned_waits_for_the_producer_without_stalling_it():
    tier = CPUTier(64 << 20, pin_memory=True)
    # warm up: a pinned buffer of this size to recycle (a first cudaHostAlloc may block)
    assert tier.put(KEYS[7], device_chunk(7))
    assert tier.get(KEYS[7]) is not None and tier.delete(KEYS[7])
    torch.cuda.synchronize()
    chunk = device_chunk(0, fill=3.0)
    start = time.perf_counter()
    assert tier.put(KEYS[0], chunk)
    queued = time.perf_counter() - start
    # the put only queued the copy: the producer's sleep is still running
    assert not torch.cuda.current_stream().query()
    assert queued < 0.05, f"put took {queued:.3f}s: it waited for the GPU"
    got = tier.get(KEYS[0])  # waits on the copy's event
    assert got is not None and got.device.type == "cpu" and got.keys.is_pinned()
    assert bool((got.keys == 3.0).all()) and bool((got.values == -3.0).all())
    assert torch.equal(got.positions, chunk.positions.cpu())
    assert len(tier._copiers) == 1


def test_load_to_device_in_order_on_the_reader_stream():
    host = CPUTier(64 << 20, pin_memory=True)
    gpu = GPUTier(64 << 20, "cuda")
    chunk = make_chunk(1, layers=4, heads=2, kept=64, dim=64, dtype=torch.bfloat16)
    assert host.put(KEYS[1], chunk)
    pinned = host.get(KEYS[1])
    assert pinned is not None
    assert gpu.put(KEYS[1], pinned)  # queued on the side stream
    got = gpu.get(KEYS[1])  # the current stream waits on the event
    assert got is not None and got.device.type == "cuda"
    assert same_chunk(got, chunk)  # .cpu() runs on the current stream, after the wait


def test_source_released_early_is_still_copied_right():
    """The caller drops its device chunk right after the put and allocates over it: the
    copy still reads the original bytes (record_stream and the pending copy keep them)."""
    tier = CPUTier(64 << 20, pin_memory=True)
    expected = make_chunk(2, layers=4, heads=2, kept=64, dim=64, dtype=torch.bfloat16)
    chunk = device_chunk(2)
    torch.cuda._sleep(sleep_cycles())
    assert tier.put(KEYS[2], chunk)
    del chunk
    junk = [torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda") for _ in range(8)]
    got = tier.get(KEYS[2])
    assert got is not None and same_chunk(got, expected)
    del junk


def test_eviction_of_an_entry_in_flight_waits_before_reuse():
    chunk = device_chunk(3, fill=1.0)
    size = chunk.payload_nbytes
    tier = CPUTier(size, pin_memory=True)  # room for one entry: the second put evicts
    assert tier.put(KEYS[3], chunk)
    other = device_chunk(4, fill=2.0)
    assert tier.put(KEYS[4], other)
    assert tier.get(KEYS[3]) is None
    got = tier.get(KEYS[4])
    assert got is not None and bool((got.keys == 2.0).all())


def test_stream_copier_to_device_batch():
    copier = StreamCopier("cuda")
    chunks = [make_chunk(i, kept=16, dtype=torch.float16).clone() for i in range(3)]
    pinned = [c.clone() for c in chunks]
    out, pending = copier.to_device(pinned)
    pending.wait()
    for got, want in zip(out, chunks, strict=True):
        assert got.device.type == "cuda" and same_chunk(got, want)


def test_put_many_batches_both_ways_and_waits_for_the_producer():
    host = CPUTier(64 << 20, pin_memory=True)
    device = GPUTier(64 << 20, "cuda")
    chunks = [device_chunk(10 + i, fill=float(i + 1)) for i in range(4)]
    items = [(KEYS[i], c) for i, c in enumerate(chunks)]
    # a repeated key in one batch is stored once
    assert host.put_many([*items, items[0]]) == [True] * 5
    assert len(host) == 4 and host.metrics()["puts"] == 4
    for i, _ in enumerate(chunks):
        got = host.get(KEYS[i])  # waits on the batch's one event
        assert got is not None and got.keys.is_pinned()
        assert bool((got.keys == i + 1).all()) and bool((got.values == -(i + 1)).all())
    pinned = [(KEYS[i], host.get(KEYS[i])) for i in range(4)]
    assert device.put_many(pinned) == [True] * 4  # type: ignore[arg-type]
    for i in range(4):
        got = device.get(KEYS[i])
        assert got is not None and got.device.type == "cuda"
        assert bool((got.keys.cpu() == i + 1).all())


def test_tiered_store_gpu_and_cpu_round_trip():
    cfg = StoreConfig(gpu_capacity_bytes=64 << 20, cpu_capacity_bytes=64 << 20)
    with TieredStore(NS, cfg) as store:
        chunk = device_chunk(5, fill=5.0)
        assert store.put(KEYS[5], chunk)
        cpu = store.tier("cpu").get(KEYS[5])
        assert cpu is not None and bool((cpu.keys == 5.0).all())
        store.tier("gpu").delete(KEYS[5])
        got = store.get(KEYS[5])  # a CPU hit, promoted to the GPU tier on the side stream
        assert got is not None and bool((got.keys == 5.0).all())
        promoted = store.tier("gpu").get(KEYS[5])
        assert promoted is not None and promoted.device.type == "cuda"
        assert bool((promoted.keys.cpu() == 5.0).all())


def test_bench_store_device_cuda(tmp_path):
    import argparse
    import json

    from lmcompact.bench import store as bench_store

    parser = argparse.ArgumentParser()
    bench_store.add_arguments(parser)
    args = parser.parse_args(
        [
            "--device",
            "cuda",
            "--no-redis",
            "--iters",
            "1",
            "--repeats",
            "1",
            "--budgets",
            "0.5",
            "--json",
            str(tmp_path / "s.json"),
        ]
    )
    assert bench_store.run(args) == 0
    row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    for key in ("d2h_vs_raw", "h2d_vs_raw", "d2h_vs_memcpy", "h2d_vs_memcpy"):
        assert row[key] > 0


def test_to_host_does_not_stall_the_current_stream():
    copier = StreamCopier("cuda")
    pages = torch.empty(4, 2, 32, 128, dtype=torch.bfloat16, device="cuda")
    # made before the sleep: a host-to-device copy from pageable memory waits for the stream
    rows = torch.tensor([3, 1], device="cuda")
    # warm-up of the same kernels and copies (a kernel's first launch waits for the device)
    pages.fill_(0.0)
    copier.to_host([pages[rows]])[1].synchronize()
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles())
    pages.fill_(1.5)  # written after the sleep, on the current stream
    gathered = pages[rows]
    start = time.perf_counter()
    host, pending = copier.to_host([gathered])
    assert time.perf_counter() - start < 0.05
    assert not torch.cuda.current_stream().query()
    del gathered  # the copy keeps its source alive
    pending.wait()
    assert host[0].is_pinned() and host[0].shape == (2, 2, 32, 128)
    assert bool((host[0] == 1.5).all())


def test_loose_and_packed_device_chunks_both_copy_right():
    """A chunk packed in one buffer goes as one copy, a loose one as three: same bytes."""
    from lmcompact.store.chunk import packed_span

    host = make_chunk(6, layers=3, heads=2, kept=32, dim=64, dtype=torch.float16)
    k, v, p = (t.cuda() for t in host.to_dense())
    loose = CompactedChunk.from_dense(k, v, p, num_tokens=host.num_tokens)
    packed = host.clone("cuda")
    assert packed_span(loose) is None and packed_span(packed) is not None
    tier = CPUTier(64 << 20, pin_memory=True)
    assert tier.put(KEYS[0], loose) and tier.put(KEYS[1], packed)
    for key in KEYS[:2]:
        got = tier.get(key)
        assert got is not None and same_chunk(got, host)
