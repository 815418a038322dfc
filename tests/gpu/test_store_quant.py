"""Quantized stored chunks on CUDA: the same bytes and rows as the CPU's (skipped without a
GPU). A quantizing store dequantizes a device chunk on its device for the memory tiers,
while a Redis reader decodes the value on the host: both must get the same rows."""

from __future__ import annotations

import pytest
import torch

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.quant import QUANT_DTYPES, dequantize_payload, quantize_payload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("mode", [m for m in ("int8", "fp8") if m in QUANT_DTYPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 3, 40, 64), (4, 2, 33, 80), (32, 8, 256, 128)])
def test_cuda_and_cpu_write_and_read_the_same_bytes(mode, dtype, shape) -> None:
    layers, heads, tokens, dim = shape
    g = torch.Generator().manual_seed(0)
    magnitude = 10.0 ** torch.randint(-5, 5, (layers, heads, tokens, 1), generator=g)
    k = (torch.randn(*shape, generator=g) * magnitude).to(dtype)
    v = (torch.randn(*shape, generator=g) * magnitude.flip(2)).to(dtype)
    k[0, 0, 1] = 0
    host = CompactedChunk.from_dense(k, v)
    device = CompactedChunk.from_dense(k.cuda(), v.cuda())
    payload, on_device = quantize_payload(host, mode), quantize_payload(device, mode)
    assert payload is not None and on_device is not None
    assert torch.equal(payload, on_device.cpu())  # every step exact or correctly rounded
    rows = (host.kept_counts, tokens, dim, dim, mode, dtype)
    a, b = dequantize_payload(payload, *rows), dequantize_payload(on_device, *rows)
    assert b.device.type == "cuda"
    assert same(a.keys, b.keys) and same(a.values, b.values) and same(a.positions, b.positions)


def test_the_quantized_cpu_tier_dequantizes_on_the_readers_device() -> None:
    """A loading GPU worker asks the store for its device: the int8 value crosses as
    bytes and is dequantized there, the same rows as a host decode."""
    from lmcompact.store import StoreConfig, TieredStore, chunk_keys
    from tests.unit.store.store_helpers import make_chunk, make_namespace

    ns = make_namespace(policy_params={"budget": 0.5, "quantize": "int8"})
    chunk = make_chunk(3, layers=4, heads=2, kept=96, dim=128, dtype=torch.bfloat16)
    key = chunk_keys(list(range(256)), ns, 256)[0]
    config = StoreConfig(cpu_capacity_bytes=1 << 26, quantize="int8", metrics_log_interval_s=None)
    with TieredStore(ns, config) as store:
        assert store.put(key, chunk)
        host = store.get_many([key])[0]
        on_gpu = store.get_many([key], torch.device("cuda"))[0]
    assert host is not None and on_gpu is not None
    assert host.keys.device.type == "cpu" and on_gpu.keys.device.type == "cuda"
    assert same(host.keys, on_gpu.keys) and same(host.values, on_gpu.values)
    assert torch.equal(host.positions, on_gpu.positions.cpu())


@pytest.mark.parametrize("workers", [1, 4])
def test_threaded_checks_give_the_host_decodes_rows_on_the_gpu(workers: int) -> None:
    """A many-chunk get to the GPU (checksums on worker threads, payloads staged through the
    page-locked ring, copies and dequantization in order on the caller's stream) gives every
    chunk's host-decoded rows, and a damaged value is refused; twice (the ring is kept,
    with 1 worker its 2 slots are refilled 6 times per get)."""
    from lmcompact.store import ChunkCodec, chunk_keys
    from lmcompact.store.tiers.encoded_cpu import PARALLEL_VERIFY_BYTES, EncodedCPUTier
    from tests.unit.store.store_helpers import make_chunk, make_namespace

    ns = make_namespace(policy_params={"budget": 0.5, "quantize": "int8"})
    codec = ChunkCodec(ns, "int8")
    tier = EncodedCPUTier(1 << 28, codec)
    tier._workers = workers
    reserved = tier.reserve_staging(900_000)  # start-up: the ring before any get
    assert reserved == 2 * workers * (1 << 20)  # 817 kB values: 1 MiB slots
    chunks = [make_chunk(20 + i, layers=8, heads=4, kept=96, dim=128) for i in range(12)]
    keys = chunk_keys(list(range(12 * 256)), ns, 256)
    assert tier.put_many(list(zip(keys, chunks, strict=True))) == [True] * 12
    assert tier.used_bytes >= PARALLEL_VERIFY_BYTES
    raw = bytearray(tier._values[keys[5]])
    raw[-7] ^= 1  # a scale byte of one value
    tier._values[keys[5]] = bytes(raw)
    got = tier.get_many(keys, torch.device("cuda"))
    assert tier._verifier is not None and got[5] is None and not tier.contains(keys[5])
    ring = tier._ring
    assert ring is not None and ring.slots == 2 * workers and ring.buffer.is_pinned()
    assert ring.slot_bytes == 1 << 20  # the reserved ring held these values: not replaced
    again = tier.get_many(keys, torch.device("cuda"))
    assert tier._ring is ring and again[5] is None
    for i, (chunk, out) in enumerate(zip(chunks, got, strict=True)):
        if i == 5:
            continue
        second = again[i]
        assert out is not None and out.keys.device.type == "cuda"
        assert second is not None and same(second.keys, out.keys)
        expected = codec.decode(codec.encode(chunk).tobytes())
        assert same(out.keys, expected.keys) and same(out.values, expected.values)
