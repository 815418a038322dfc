"""The Redis tier and the tiered store against a real ``redis-server``."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import redis
import torch

from lmcompact.store import (
    ChunkCodec,
    CompactedChunk,
    StoreConfig,
    TieredStore,
    chunk_keys,
)
from lmcompact.store.chunk import SUPPORTED_DTYPES
from lmcompact.store.codec import QUANTIZED_VALUE_VERSION
from lmcompact.store.tiers.redis_tier import RedisTier
from tests.support.redis_process import RedisProcess, free_port
from tests.unit.store.store_helpers import make_chunk, make_namespace, same_chunk
from tests.unit.store.test_store_codec import V1_CRC32

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
]

NS = make_namespace()
TOKENS = list(range(5000, 5000 + 256 * 40))
KEYS = chunk_keys(TOKENS, NS, 256)


def redis_tier(url: str, **kw) -> RedisTier:
    kw.setdefault("backoff_initial_s", 0.05)
    kw.setdefault("backoff_max_s", 0.2)
    kw.setdefault("socket_timeout_s", 1.0)
    return RedisTier(url, ChunkCodec(NS), **kw)


@pytest.mark.parametrize("dtype_name", sorted(SUPPORTED_DTYPES))
def test_round_trip_dtypes(redis_server, dtype_name):
    dtype = SUPPORTED_DTYPES[dtype_name]
    tier = redis_tier(redis_server.url)
    g = torch.Generator().manual_seed(0)
    k = torch.randint(0, 256, (2, 3, 5, 16), generator=g, dtype=torch.uint8)
    # random bit patterns (NaNs included) must come back bit-exact
    chunk = CompactedChunk.from_dense(
        k.view(dtype) if dtype.itemsize == 1 else torch.randn(2, 3, 5, 16).to(dtype),
        torch.randn(2, 3, 5, 8).to(dtype) if dtype.itemsize > 1 else k[..., :8].view(dtype),
        torch.tensor([0, 1, 4, 6, 7]),
        num_tokens=8,
    )
    assert tier.put(KEYS[0], chunk)
    got = tier.get(KEYS[0])
    assert got is not None and got.dtype == dtype and same_chunk(got, chunk)
    assert tier.metrics()["hits"] == 1 and tier.metrics()["rejected"] == 0


def test_batched_get_put_and_contains(redis_server):
    tier = redis_tier(redis_server.url)
    items = [(KEYS[i], make_chunk(i)) for i in range(6)]
    assert tier.put_many(items) == [True] * 6
    got = tier.get_many(KEYS[:8])
    assert [g is not None for g in got] == [True] * 6 + [False] * 2
    assert all(same_chunk(got[i], make_chunk(i)) for i in range(6))
    assert tier.contains_many(KEYS[4:8]) == [True, True, False, False]
    m = tier.metrics()
    assert (m["hits"], m["misses"], m["puts"]) == (6, 2, 6)
    assert tier.delete(KEYS[0]) and not tier.contains(KEYS[0])


def key_script() -> str:
    return (
        "from lmcompact.store import chunk_keys;"
        "from tests.unit.store.store_helpers import make_namespace;"
        f"print(','.join(k.hex() for k in chunk_keys(list(range(5000, {5000 + 256 * 40})),"
        " make_namespace(), 256)))"
    )


def test_keys_are_stable_across_processes():
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", key_script()],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip().split(",") == [k.hex() for k in KEYS]


def raw_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def rewrite_header(value: bytes, **changes) -> bytes:
    hlen = struct.unpack_from("<I", value, 4)[0]
    header = msgpack.unpackb(value[8 : 8 + hlen])
    header.update(changes)
    packed = msgpack.packb(header, use_bin_type=True)
    payload = value[8 + hlen + (-(8 + hlen) % 16) :]
    return (
        b"LMCK" + struct.pack("<I", len(packed)) + packed + bytes(-(8 + len(packed)) % 16) + payload
    )


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda v: v[:400] + bytes([v[400] ^ 0x10]) + v[401:], "checksum_mismatch"),
        (lambda v: v[: len(v) // 2], "truncated"),
        (lambda v: rewrite_header(v, v=QUANTIZED_VALUE_VERSION + 1), "unsupported_version"),
        (lambda v: bytes.fromhex(V1_CRC32), "unsupported_version"),  # the previous format
        (
            lambda v: ChunkCodec(make_namespace(model_id="other")).encode(make_chunk(0)).tobytes(),
            "foreign_namespace",
        ),
        (lambda v: v[:-5] + bytes([v[-5] ^ 1]) + v[-4:], "checksum_mismatch"),
    ],
)
def test_bad_values_are_refused_counted_and_removed(redis_server, damage, reason):
    tier = redis_tier(redis_server.url)
    assert tier.put(KEYS[0], make_chunk(0))
    r = raw_client(redis_server.url)
    rkey = tier.redis_key(KEYS[0])
    r.set(rkey, damage(r.get(rkey)))
    assert tier.get(KEYS[0]) is None
    m = tier.metrics()
    assert m["rejected"] == 1 and m["misses"] == 1 and m["hits"] == 0
    assert tier.codec.metrics()[reason] == 1
    assert r.exists(rkey) == 0  # the bad value was deleted
    assert tier.put(KEYS[0], make_chunk(0))  # recomputed and written again
    assert same_chunk(tier.get(KEYS[0]), make_chunk(0))


def test_quantized_store_round_trip_through_redis(redis_server):
    """An int8 store writes quantized values to Redis (about half of bf16's bytes), and a
    second store of the same namespace reading them back from Redis alone gets the very
    rows the first store's CPU tier serves; an unquantized value under its key is refused
    and deleted."""
    ns = make_namespace(policy_params={"budget": 1.0, "quantize": "int8"})
    keys = chunk_keys(TOKENS[: 256 * 3], ns, 256)
    chunks = [make_chunk(i, kept=64, dim=128, dtype=torch.bfloat16) for i in range(3)]
    cfg = StoreConfig(
        cpu_capacity_bytes=16 << 20,
        redis_url=redis_server.url,
        quantize="int8",
        redis_backoff_initial_s=0.05,
        redis_backoff_max_s=0.1,
    )
    r = raw_client(redis_server.url)
    with TieredStore(ns, cfg) as writer:
        assert writer.put_many(list(zip(keys, chunks, strict=True))) == [True] * 3
        assert writer.flush(10)
        served = [writer.tier("cpu").get(k) for k in keys]
        redis = writer.tier("redis")
        assert isinstance(redis, RedisTier)
        plain = ChunkCodec(make_namespace()).encode(chunks[0])
        stored = r.strlen(redis.redis_key(keys[0]))
        assert stored <= 0.52 * len(plain)
    reader_cfg = StoreConfig(
        cpu_capacity_bytes=None, redis_url=redis_server.url, redis_async_writes=False
    )
    with TieredStore(ns, reader_cfg) as reader:  # a fresh engine: Redis only
        got = reader.get_many(keys)
        for chunk, back, mine in zip(chunks, got, served, strict=True):
            assert back is not None and mine is not None and same_chunk(back, mine)
            assert back.dtype == torch.bfloat16
            err = (back.keys.float() - chunk.keys.float()).abs()
            step = chunk.keys.float().abs().amax(dim=1, keepdim=True) / 127
            assert (err <= step / 2 * (1 + 2**-9) + back.keys.float().abs() * 2**-8).all()
        rkey = reader.tier("redis").redis_key(keys[1])  # type: ignore[attr-defined]
        r.set(rkey, plain.tobytes())  # another namespace's (unquantized) bytes
        assert reader.get(keys[1]) is None
        assert reader.metrics()["codec_rejected"]["foreign_namespace"] == 1
        assert r.exists(rkey) == 0


def test_batches_take_one_round_trip_each(redis_server, monkeypatch):
    """put_many / get_many of 6 chunks write their commands in one send and read the
    replies after it (no request waits on the previous reply)."""
    tier = redis_tier(redis_server.url)
    items = [(KEYS[i], make_chunk(i, kept=64, dim=64)) for i in range(6)]
    sends: list[int] = []
    original = redis.connection.Connection.send_packed_command

    def spy(self, command, check_health=True):
        sends.append(len(command))
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", spy)
    assert tier.put_many(items) == [True] * 6
    assert len(sends) == 1
    got = tier.get_many([k for k, _ in items])
    assert len(sends) == 2
    assert all(g is not None and same_chunk(g, c) for g, (_, c) in zip(got, items, strict=True))


def test_refused_sets_do_not_derail_the_batch():
    """Under maxmemory without eviction Redis refuses some SETs (OOM): those puts fail, the
    others succeed, the tier stays healthy and the connection stays in step."""
    with RedisProcess(extra_args=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) as s:
        tier = redis_tier(s.url)
        items = [(KEYS[i], make_chunk(i, kept=128, dim=64)) for i in range(24)]  # ~0.4 MB each
        ok = tier.put_many(items)
        assert ok[0] and not all(ok)
        assert tier.healthy and tier.metrics()["errors"] == ok.count(False)
        stored = [k for (k, _), good in zip(items, ok, strict=True) if good]
        assert all(g is not None for g in tier.get_many(stored))
        assert tier.contains_many([k for k, _ in items]) == ok


def test_redis_killed_mid_run_then_recovers(redis_server, caplog):
    tier = redis_tier(redis_server.url)
    assert tier.put(KEYS[0], make_chunk(0)) and tier.healthy
    redis_server.kill()
    with caplog.at_level("WARNING", logger="lmcompact.store.tiers.redis_tier"):
        for i in range(5):
            assert tier.get(KEYS[i]) is None
            assert tier.put(KEYS[i], make_chunk(i)) is False
            assert tier.contains(KEYS[i]) is False
    assert not tier.healthy
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    m = tier.metrics()
    assert m["misses"] == 5 and m["put_failures"] == 5 and m["errors"] >= 1
    redis_server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 5
    while not tier.put(KEYS[1], make_chunk(1)):
        assert time.monotonic() < deadline, "tier did not recover"
        time.sleep(0.05)
    assert tier.healthy
    assert same_chunk(tier.get(KEYS[1]), make_chunk(1))


def test_unreachable_at_start_never_raises():
    url = f"redis://127.0.0.1:{free_port()}/0"
    tier = redis_tier(url)
    assert not tier.healthy
    assert tier.get(KEYS[0]) is None and tier.put(KEYS[0], make_chunk(0)) is False
    store = TieredStore(
        NS,
        StoreConfig(
            cpu_capacity_bytes=1 << 20,
            redis_url=url,
            redis_backoff_initial_s=0.05,
            redis_backoff_max_s=0.1,
        ),
    )
    assert store.put(KEYS[0], make_chunk(0))  # the CPU tier took it
    assert store.get(KEYS[1]) is None
    assert store.lookup_prefix(KEYS[:3]) == 1
    store.close()


def test_store_survives_redis_kill_and_reads_back_after_restart(redis_server):
    cfg = StoreConfig(
        cpu_capacity_bytes=2 * make_chunk(0).payload_nbytes,
        redis_url=redis_server.url,
        redis_backoff_initial_s=0.05,
        redis_backoff_max_s=0.1,
    )
    with TieredStore(NS, cfg) as store:
        for i in range(4):
            assert store.put(KEYS[i], make_chunk(i))
        assert store.flush(10)
        assert store.lookup_prefix(KEYS[:5]) == 4  # 0 and 1 only in Redis now
        got = store.get(KEYS[0])
        assert got is not None and same_chunk(got, make_chunk(0))
        assert store.tier("cpu").contains(KEYS[0])  # promoted
        redis_server.kill()
        assert store.get(KEYS[2]) is None or store.tier("cpu").contains(KEYS[2])
        for i in range(4, 8):
            assert store.put(KEYS[i], make_chunk(i))
        assert store.flush(10)
        m = store.metrics()
        assert m["redis"]["healthy"] is False and m["writers"]["redis"]["failed"] >= 1


def test_ttl_and_password_db_url():
    with RedisProcess(extra_args=["--requirepass", "s3cret"]) as server:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        tier = redis_tier(url, ttl_s=0.3)
        assert tier.put(KEYS[0], make_chunk(0))
        r = redis.Redis.from_url(url)
        assert 0 < r.pttl(tier.redis_key(KEYS[0])) <= 300
        assert r.dbsize() == 1 and redis.Redis.from_url(url.replace("/3", "/0")).dbsize() == 0
        time.sleep(0.4)
        assert tier.get(KEYS[0]) is None
        wrong = redis_tier(url.replace("s3cret", "nope"))
        assert wrong.get(KEYS[0]) is None  # auth failure: a miss, no raise
        assert wrong.put(KEYS[0], make_chunk(0)) is False


def test_redis_capacity_limit_with_lru():
    with RedisProcess(extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]) as s:
        tier = redis_tier(s.url)
        big = make_chunk(0, kept=128, dim=64)  # ~0.4 MB
        for i in range(12):
            assert tier.put(KEYS[i], make_chunk(i, kept=128, dim=64))
        info = redis.Redis.from_url(s.url).info("memory")
        assert info["used_memory"] <= 4 * 1024 * 1024 * 1.1
        present = tier.contains_many(KEYS[:12])
        assert present[-1] and not all(present)
        assert same_chunk(tier.get(KEYS[11]), make_chunk(11, kept=128, dim=64))
        assert 12 * big.payload_nbytes > 4 * 1024 * 1024


def test_concurrent_threads_no_lost_or_mixed_entries(redis_server):
    size = make_chunk(0).payload_nbytes
    cfg = StoreConfig(
        cpu_capacity_bytes=5 * size,
        redis_url=redis_server.url,
        redis_queue_size=256,
        redis_queue_timeout_s=5.0,
    )
    errors: list[str] = []
    with TieredStore(NS, cfg) as store:

        def work(tid: int) -> None:
            for i in range(8):
                idx = tid * 8 + i
                store.put(KEYS[idx], make_chunk(idx))
                for j in (idx, max(0, idx - 3)):
                    got = store.get(KEYS[j])
                    if got is not None and not same_chunk(got, make_chunk(j)):
                        errors.append(f"thread {tid}: key {j} came back with other content")

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.flush(30)
        assert not errors
        w = store.metrics()["writers"]["redis"]
        assert w["dropped"] == 0 and w["failed"] == 0 and w["written"] == 32
        fetched = store.tier("redis").get_many(KEYS[:32])
        assert all(f is not None and same_chunk(f, make_chunk(i)) for i, f in enumerate(fetched))


def test_bench_store_with_redis(tmp_path):
    """The bench's Redis pair runs against its own private redis-server."""
    import argparse
    import json

    from lmcompact.bench import store as bench_store

    parser = argparse.ArgumentParser()
    bench_store.add_arguments(parser)
    args = parser.parse_args(
        [
            "--layers",
            "2",
            "--kv-heads",
            "2",
            "--chunk-tokens",
            "64",
            "--chunks",
            "2",
            "--iters",
            "1",
            "--repeats",
            "2",
            "--budgets",
            "0.5",
            "--json",
            str(tmp_path / "s.json"),
        ]
    )
    assert bench_store.run(args) == 0
    row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    assert row["redis_vs_raw"] > 0 and row["raw_get_gbps"] > 0 and row["redis_put_gbps"] > 0
