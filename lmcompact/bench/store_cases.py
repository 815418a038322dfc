"""The measured cases of ``lmcompact bench store``: one budget's chunks through every tier.

:class:`BudgetCase` builds SmolLM2-sized chunks compacted to one budget and times, round
by round, each baseline (a torch copy, raw redis-py) next to the path it is compared
with (CPU / GPU tier, codec, Redis tier); :meth:`BudgetCase.row` turns the rounds into
throughputs and ratios (see :mod:`lmcompact.bench.store` for their definitions).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcompact.bench.store_cuda import CudaCase, cuda_row
from lmcompact.store.chunk import SUPPORTED_DTYPES, CompactedChunk
from lmcompact.store.codec import ChunkCodec
from lmcompact.store.keys import ChunkKeyer, StoreNamespace
from lmcompact.store.tiers.cpu_tier import CPUTier
from lmcompact.store.tiers.gpu_tier import GPUTier
from lmcompact.store.tiers.memory import MemoryTier


def _rounds(
    steps: Sequence[tuple[str, Callable[[], object], Callable[[], object] | None]], iters: int
) -> dict[str, list[float]]:
    """Times of each named step over ``iters`` rounds; a round runs every step once, in
    order, each after its (untimed) reset. One untimed warm-up round comes first."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in steps}
    for i in range(iters + 1):
        for name, fn, reset in steps:
            if reset is not None:
                reset()
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - start)
    return times


Stat = Callable[[Sequence[float]], float]


def _ratio(
    t: dict[str, list[float]], base: Sequence[str], store: Sequence[str], stat: Stat
) -> float:
    """Baseline time over store time, each the sum over its steps of the step's ``stat``
    over rounds (``statistics.median``; ``min`` for the ``*_best`` ratios)."""
    return sum(stat(t[s]) for s in base) / sum(stat(t[s]) for s in store)


def _make_chunks(
    args: argparse.Namespace, budget: float
) -> tuple[list[CompactedChunk], list[torch.Tensor]]:
    """``args.chunks`` chunks of ``budget``, each packed in one buffer (as in the memory
    tiers); returns the chunks and their buffers."""
    dtype = SUPPORTED_DTYPES[args.dtype]
    kept = max(1, round(args.chunk_tokens * budget))
    chunks, buffers = [], []
    for seed in range(args.chunks):
        g = torch.Generator().manual_seed(seed)
        shape = (args.layers, args.kv_heads, kept, args.head_dim)
        k = torch.randn(shape, generator=g).to(dtype)
        v = torch.randn(shape, generator=g).to(dtype)
        pos = torch.randperm(args.chunk_tokens, generator=g)[:kept].sort().values
        chunk = CompactedChunk.from_dense(k, v, pos, num_tokens=args.chunk_tokens)
        buf = torch.empty(chunk.payload_nbytes, dtype=torch.uint8)
        chunks.append(chunk.pack_into(buf))
        buffers.append(buf)
    return chunks, buffers


class BudgetCase:
    """Everything measured at one budget, set up once and timed in rounds."""

    def __init__(self, args: argparse.Namespace, budget: float, redis_url: str | None) -> None:
        self.budget = budget
        ns = StoreNamespace("bench", args.dtype, "bench", policy_params={"budget": budget})
        self.keys = ChunkKeyer(ns, args.chunk_tokens).keys(
            list(range(args.chunk_tokens * args.chunks))
        )
        # the memcpy baseline copies exactly the buffers the codec and the tiers read
        self.chunks, self.srcs = _make_chunks(args, budget)
        self.dsts = [torch.empty_like(s) for s in self.srcs]
        self.nbytes = sum(c.payload_nbytes for c in self.chunks)
        cap = 2 * self.nbytes
        self.memory_tiers: list[MemoryTier] = [CPUTier(cap), GPUTier(cap)]
        self.codec = ChunkCodec(ns)
        self.received = [self.codec.encode(c).tobytes() for c in self.chunks]
        self.redis = (
            _RedisCase(redis_url, self.codec, self.keys, self.chunks) if redis_url else None
        )
        self.cuda: CudaCase | None = None
        if args.device == "cuda":
            self.cuda = CudaCase(self.keys, self.chunks)
        self.samples: dict[str, list[float]] = {}

    def steps(self) -> list[tuple[str, Callable[[], object], Callable[[], object] | None]]:
        out: list[tuple[str, Callable[[], object], Callable[[], object] | None]] = [
            ("memcpy", self._memcpy, None),
            ("encode", self._encode, None),
            ("decode", self._decode, None),
        ]
        for tier in self.memory_tiers:
            out.append(
                (
                    f"{tier.name}_put",
                    _tier_put(tier, self.keys, self.chunks),
                    _tier_reset(tier, self.keys),
                )
            )
            out.append((f"{tier.name}_get", _tier_get(tier, self.keys), None))
        if self.redis is not None:
            out += self.redis.steps()
        if self.cuda is not None:
            out += self.cuda.steps()
        return out

    def measure(self, iters: int) -> None:
        for name, times in _rounds(self.steps(), iters).items():
            self.samples.setdefault(name, []).extend(times)

    def row(self) -> dict[str, Any]:
        t = self.samples
        med = statistics.median
        gbps = {name: self.nbytes / med(times) / 1e9 for name, times in t.items()}
        row: dict[str, Any] = {
            "budget": self.budget,
            "chunk_mib": self.chunks[0].payload_nbytes / 2**20,
            "rounds": len(t["memcpy"]),
            "memcpy_gbps": gbps["memcpy"],
        }
        for tier in self.memory_tiers:
            row[f"{tier.name}_device"] = str(tier.device)
            row[f"{tier.name}_put_gbps"] = gbps[f"{tier.name}_put"]
            row[f"{tier.name}_get_gbps"] = gbps[f"{tier.name}_get"]
            row[f"{tier.name}_vs_memcpy"] = _ratio(
                t, ["memcpy"], [f"{tier.name}_put", f"{tier.name}_get"], med
            )
        row["encode_gbps"] = gbps["encode"]
        row["decode_gbps"] = gbps["decode"]
        row["codec_vs_memcpy"] = _ratio(t, ["memcpy"], ["encode", "decode"], med)
        row["codec_vs_memcpy_best"] = _ratio(t, ["memcpy"], ["encode", "decode"], min)
        if self.redis is not None:
            for name in ("raw_set", "raw_get", "redis_put", "redis_get"):
                row[f"{name}_gbps"] = gbps[name]
            raw, stored = ["raw_set", "raw_get"], ["redis_put", "redis_get"]
            row["redis_vs_raw"] = _ratio(t, raw, stored, med)
            row["redis_vs_raw_best"] = _ratio(t, raw, stored, min)
        if self.cuda is not None:
            row.update(cuda_row(t, self.nbytes, _ratio))
        row["times_s"] = {name: [round(x, 7) for x in times] for name, times in t.items()}
        return row

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()

    def _memcpy(self) -> None:
        for s, d in zip(self.srcs, self.dsts, strict=True):
            d.copy_(s)

    def _encode(self) -> None:
        for c in self.chunks:
            self.codec.encode(c)

    def _decode(self) -> None:
        for v in self.received:  # what a reader gets from Redis
            self.codec.decode(v)


def _tier_put(
    tier: MemoryTier, keys: Sequence[Any], chunks: Sequence[CompactedChunk]
) -> Callable[[], None]:
    def put() -> None:
        for k, c in zip(keys, chunks, strict=True):
            if not tier.put(k, c):
                raise RuntimeError(f"{tier.name} tier refused a put")

    return put


def _tier_get(tier: MemoryTier, keys: Sequence[Any]) -> Callable[[], None]:
    def get() -> None:
        for k in keys:
            if tier.get(k) is None:
                raise RuntimeError(f"{tier.name} tier lost an entry")
        if tier.device.type == "cuda":  # device copies are asynchronous: time their end
            torch.cuda.synchronize(tier.device)

    return get


def _tier_reset(tier: MemoryTier, keys: Sequence[Any]) -> Callable[[], None]:
    def reset() -> None:
        for k in keys:
            tier.delete(k)

    return reset


class _RedisCase:
    """The Redis tier against raw redis-py on the same server, same sizes."""

    def __init__(
        self, url: str, codec: ChunkCodec, keys: Sequence[Any], chunks: Sequence[CompactedChunk]
    ) -> None:
        import redis
        from redis.cluster import ClusterNode, RedisCluster

        from lmcompact.store.tiers.redis_tier import RedisTier
        from lmcompact.store.tiers.redis_url import is_cluster_url, parse_cluster_url

        self.tier = RedisTier(url, codec)
        self.client: redis.Redis | RedisCluster
        if is_cluster_url(url):
            address = parse_cluster_url(url)
            self.client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in address.seeds],
                username=address.username,
                password=address.password,
                ssl=address.tls,
            )
        else:
            self.client = redis.Redis.from_url(url)
        # the tier key as hash tag: on a cluster each raw value lives where its chunk does
        self.raw_keys = [b"lmc-bench-raw:{" + self.tier.redis_key(k) + b"}" for k in keys]
        self.raw_values = [bytes(len(codec.encode(c))) for c in chunks]
        self.keys = list(keys)
        self.items = list(zip(keys, chunks, strict=True))

    def steps(self) -> list[tuple[str, Callable[[], object], Callable[[], object] | None]]:
        return [
            ("raw_set", self._raw_set, None),
            ("raw_get", self._raw_get, None),
            ("redis_put", self._put, None),
            ("redis_get", self._get, None),
        ]

    def _raw_set(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k, v in zip(self.raw_keys, self.raw_values, strict=True):
            pipe.set(k, v)
        pipe.execute()

    def _raw_get(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k in self.raw_keys:
            pipe.get(k)
        if any(v is None for v in pipe.execute()):
            raise RuntimeError("raw redis lost a value")

    def _put(self) -> None:
        if not all(self.tier.put_many(self.items)):
            raise RuntimeError("redis tier refused a put")

    def _get(self) -> None:
        if any(c is None for c in self.tier.get_many(self.keys)):
            raise RuntimeError("redis tier lost an entry")

    def close(self) -> None:
        self.client.delete(*self.raw_keys)
        for k in self.keys:
            self.tier.delete(k)
        self.tier.close()
        self.client.close()
