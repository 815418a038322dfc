"""The quantized CPU tier: a quantizing store's host memory holds the quantized values
(bytes <= 0.52x of bf16), serves the rows they decode to, evicts least recently used
values but never pinned ones, and refuses damaged values."""

from __future__ import annotations

import pytest
import torch

from lmcompact.store import ChunkCodec, StoreConfig, TieredStore, chunk_keys
from lmcompact.store.tiers.encoded_cpu import EncodedCPUTier
from tests.unit.store.store_helpers import make_chunk, make_namespace, same_chunk

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

NS = make_namespace(policy_params={"budget": 0.5, "quantize": "int8"})


def quantized_store(capacity: int = 1 << 24) -> TieredStore:
    cfg = StoreConfig(cpu_capacity_bytes=capacity, quantize="int8", metrics_log_interval_s=None)
    return TieredStore(NS, cfg)


def test_a_quantizing_store_keeps_quantized_bytes_in_host_memory() -> None:
    chunk = make_chunk(1, layers=2, heads=2, kept=64, dim=64, dtype=torch.bfloat16)
    key = chunk_keys(list(range(128)), NS, 128)[0]
    with quantized_store() as store:
        tier = store.tier("cpu")
        assert isinstance(tier, EncodedCPUTier)
        assert store.put(key, chunk)
        bf16_rows = chunk.keys.numel() * 2 + chunk.values.numel() * 2
        assert tier.used_bytes <= 0.55 * bf16_rows  # value frame included
        got = store.get(key)
        expected = ChunkCodec(NS, quantize="int8").decode(
            ChunkCodec(NS, "int8").encode(chunk).tobytes()
        )
        assert got is not None and same_chunk(got, expected)
        assert not same_chunk(got, chunk)  # lossy: these are the dequantized rows
        err = (got.keys.float() - chunk.keys.float()).abs().max()
        assert err <= chunk.keys.float().abs().max() / 127  # within a step of every row's max


def test_least_recently_used_values_go_first_and_pinned_ones_stay() -> None:
    chunks = [make_chunk(i, kept=32, dim=32, dtype=torch.bfloat16) for i in range(3)]
    keys = chunk_keys(list(range(3 * 64)), NS, 64)
    size = len(ChunkCodec(NS, "int8").encode(chunks[0]))
    with quantized_store(capacity=2 * size + 1) as store:
        tier = store.tier("cpu")
        assert store.put(keys[0], chunks[0]) and store.put(keys[1], chunks[1])
        assert store.get(keys[0]) is not None  # keys[1] is now the least recently used
        assert store.put(keys[2], chunks[2])
        assert tier.contains(keys[0]) and not tier.contains(keys[1]) and tier.contains(keys[2])
        pinned = store.pin([keys[0], keys[2]])
        assert not store.put(keys[1], chunks[1])  # everything held is being loaded
        assert tier.stats.snapshot()["put_failures"] == 1
        store.unpin(pinned)
        assert store.put(keys[1], chunks[1])
        with pytest.raises(RuntimeError):
            store.unpin(pinned)


def test_a_damaged_value_is_refused_and_dropped() -> None:
    chunk = make_chunk(5, kept=16, dim=32, dtype=torch.bfloat16)
    key = chunk_keys(list(range(64)), NS, 64)[0]
    with quantized_store() as store:
        tier = store.tier("cpu")
        assert isinstance(tier, EncodedCPUTier)
        assert store.put(key, chunk)
        raw = bytearray(tier._values[key])
        raw[-3] ^= 0x10  # a scale byte
        tier._values[key] = bytes(raw)
        assert store.get(key) is None
        assert not tier.contains(key) and tier.used_bytes == 0
        assert tier.stats.snapshot()["rejected"] == 1


def test_a_many_chunk_get_verifies_on_threads_and_refuses_only_the_damaged_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above PARALLEL_VERIFY_BYTES the checksums run on worker threads ahead of the
    decodes: the same rows as one-by-one decoding, and a damaged value still refused."""
    import lmcompact.store.tiers.encoded_cpu as encoded_cpu

    monkeypatch.setattr(encoded_cpu, "PARALLEL_VERIFY_BYTES", 1)
    chunks = [make_chunk(10 + i, kept=16, dim=32, dtype=torch.bfloat16) for i in range(6)]
    keys = chunk_keys(list(range(6 * 64)), NS, 64)
    codec = ChunkCodec(NS, "int8")
    with quantized_store() as store:
        tier = store.tier("cpu")
        assert isinstance(tier, EncodedCPUTier)
        for key, chunk in zip(keys, chunks, strict=True):
            assert store.put(key, chunk)
        raw = bytearray(tier._values[keys[3]])
        raw[-5] ^= 0x01
        tier._values[keys[3]] = bytes(raw)
        got = tier.get_many(keys)
        assert tier._verifier is not None  # the threaded path ran
        for i, (chunk, out) in enumerate(zip(chunks, got, strict=True)):
            if i == 3:
                assert out is None
                continue
            assert out is not None
            assert same_chunk(out, codec.decode(codec.encode(chunk).tobytes()))
        assert not tier.contains(keys[3]) and tier.stats.snapshot()["rejected"] == 1
        assert tier.codec.metrics()["checksum_mismatch"] == 1  # counted once, by verify
