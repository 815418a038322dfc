"""``lmcompact bench store``: throughput of the store tiers and codec against baselines.

Chunks are the size SmolLM2-135M produces (256 tokens x 30 layers x 3 kv heads x 64 dims,
K and V in bf16: 5.6 MiB) and their compacted sizes at budgets 0.5 and 0.25. Every tier is
measured against a baseline run in the same process on the same bytes:

* CPU / GPU tier put+get  vs  ``torch`` copy of the same bytes into a preallocated buffer;
* codec encode+decode     vs  the same copy;
* Redis tier put+get      vs  raw redis-py pipelined SET+GET of equal-sized byte values.

Each timed repetition runs the baseline and the measured path back to back on the same
bytes, and a ratio is the median over repetitions of baseline time / measured time
(1.0 = as fast as the baseline), so load from other processes on a shared host hits both
sides of one ratio alike. Throughputs (GB/s) are payload bytes over the median time.

* ``codec_vs_memcpy``: encode (frame head + xxh3-128 over header and payload, the payload
  left in place as views) plus decode (checks, xxh3-128, tensors viewing the received bytes)
  against one copy of the same payload bytes;
* ``redis_vs_raw``: the tier's ``put_many`` + ``get_many`` of a batch (encode and decode
  included) against redis-py's own pipelined SET + GET of byte values of the encoded
  values' lengths, on the same server and connection pool settings.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lmcompact.cli._output import format_table, write_json
from lmcompact.store.chunk import SUPPORTED_DTYPES, CompactedChunk
from lmcompact.store.codec import ChunkCodec
from lmcompact.store.keys import ChunkKeyer, StoreNamespace
from lmcompact.store.tiers.cpu_tier import CPUTier
from lmcompact.store.tiers.gpu_tier import GPUTier
from lmcompact.store.tiers.memory import MemoryTier

NAME = "store"
HELP = "store tiers and codec throughput vs memcpy and raw redis-py (chunk sizes of SmolLM2)"

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", default=None, help="write results to this JSON file ('-': stdout)"
    )
    parser.add_argument("--budgets", default="1.0,0.5,0.25", help="kept fractions of a chunk")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per batch")
    parser.add_argument("--iters", type=int, default=15, help="timed repetitions (median kept)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(SUPPORTED_DTYPES))
    parser.add_argument(
        "--redis-url", default=None, help="Redis to use; default: start a private redis-server"
    )
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis measurements")
    parser.add_argument("--plot", default=None, help="PNG path (default: beside --json)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for tiers and baselines alike (on a busy shared host, "
        "more than one makes every copy wait for a descheduled worker)",
    )


def _median_time(fn: Callable[[], object], iters: int, reset: Callable[[], object] | None) -> float:
    times = []
    for i in range(iters + 1):  # first run warms up
        if reset is not None:
            reset()
        start = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _paired_times(fns: Sequence[Callable[[], object]], iters: int) -> list[list[float]]:
    """Per function, its times over ``iters`` rounds; each round runs every function once,
    in order (after one untimed warm-up round)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(iters + 1):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            if i:
                out.append(time.perf_counter() - start)
    return times


def _median_ratio(base: Sequence[float], other: Sequence[float]) -> float:
    return statistics.median(b / o for b, o in zip(base, other, strict=True))


def _make_chunks(args: argparse.Namespace, budget: float) -> list[CompactedChunk]:
    dtype = SUPPORTED_DTYPES[args.dtype]
    kept = max(1, round(args.chunk_tokens * budget))
    out = []
    for seed in range(args.chunks):
        g = torch.Generator().manual_seed(seed)
        shape = (args.layers, args.kv_heads, kept, args.head_dim)
        k = torch.randn(shape, generator=g).to(dtype)
        v = torch.randn(shape, generator=g).to(dtype)
        pos = torch.randperm(args.chunk_tokens, generator=g)[:kept].sort().values
        out.append(CompactedChunk.from_dense(k, v, pos, num_tokens=args.chunk_tokens))
    return out


def _memory_tier_times(
    tier: MemoryTier, keys: list[Any], chunks: list[CompactedChunk], iters: int
) -> tuple[float, float]:
    def put() -> None:
        for k, c in zip(keys, chunks, strict=True):
            if not tier.put(k, c):
                raise RuntimeError(f"{tier.name} tier refused a put")

    def get() -> None:
        for k in keys:
            if tier.get(k) is None:
                raise RuntimeError(f"{tier.name} tier lost an entry")

    def reset() -> None:
        for k in keys:
            tier.delete(k)

    t_put = _median_time(put, iters, reset)
    t_get = _median_time(get, iters, None)
    return t_put, t_get


def _bench_budget(
    args: argparse.Namespace, budget: float, redis_url: str | None, step: Callable[[], None]
) -> dict[str, Any]:
    ns = StoreNamespace("bench", args.dtype, "bench", policy_params={"budget": budget})
    keys = ChunkKeyer(ns, args.chunk_tokens).keys(list(range(args.chunk_tokens * args.chunks)))
    chunks = _make_chunks(args, budget)
    nbytes = sum(c.payload_nbytes for c in chunks)
    row: dict[str, Any] = {"budget": budget, "chunk_mib": chunks[0].payload_nbytes / 2**20}

    # Each chunk lives packed in one buffer (as in the memory tiers), and the memcpy baseline
    # copies exactly that buffer: the bytes the codec reads when it encodes the chunk.
    srcs = [torch.empty(c.payload_nbytes, dtype=torch.uint8) for c in chunks]
    chunks = [c.pack_into(s) for s, c in zip(srcs, chunks, strict=True)]
    dsts = [torch.empty_like(s) for s in srcs]

    def memcpy() -> None:
        for s, d in zip(srcs, dsts, strict=True):
            d.copy_(s)

    t_memcpy = _median_time(memcpy, args.iters, None)
    row["memcpy_gbps"] = nbytes / t_memcpy / 1e9
    step()

    cap = 2 * nbytes
    for name, tier in (("cpu", CPUTier(cap)), ("gpu", GPUTier(cap))):
        t_put, t_get = _memory_tier_times(tier, keys, chunks, args.iters)
        row[f"{name}_device"] = str(tier.device)
        row[f"{name}_put_gbps"] = nbytes / t_put / 1e9
        row[f"{name}_get_gbps"] = nbytes / t_get / 1e9
        row[f"{name}_vs_memcpy"] = t_memcpy / (t_put + t_get)
        step()

    codec = ChunkCodec(ns)
    received = [codec.encode(c).tobytes() for c in chunks]  # what a reader gets from Redis

    def encode() -> None:
        for c in chunks:
            codec.encode(c)

    def decode() -> None:
        for v in received:
            codec.decode(v)

    t_copy, t_enc, t_dec = _paired_times([memcpy, encode, decode], args.iters)
    row["encode_gbps"] = nbytes / statistics.median(t_enc) / 1e9
    row["decode_gbps"] = nbytes / statistics.median(t_dec) / 1e9
    row["codec_vs_memcpy"] = _median_ratio(
        t_copy, [e + d for e, d in zip(t_enc, t_dec, strict=True)]
    )
    step()

    if redis_url is not None:
        row.update(_bench_redis(redis_url, codec, keys, chunks, args.iters))
    step()
    return row


def _bench_redis(
    url: str,
    codec: ChunkCodec,
    keys: list[Any],
    chunks: list[CompactedChunk],
    iters: int,
) -> dict[str, float]:
    import redis

    from lmcompact.store.tiers.redis_tier import RedisTier

    nbytes = sum(c.payload_nbytes for c in chunks)
    client = redis.Redis.from_url(url)
    raw_keys = [f"lmc-bench-raw:{i}".encode() for i in range(len(chunks))]
    raw_values = [bytes(len(codec.encode(c))) for c in chunks]

    def raw_set() -> None:
        pipe = client.pipeline(transaction=False)
        for k, v in zip(raw_keys, raw_values, strict=True):
            pipe.set(k, v)
        pipe.execute()

    def raw_get() -> None:
        pipe = client.pipeline(transaction=False)
        for k in raw_keys:
            pipe.get(k)
        if any(v is None for v in pipe.execute()):
            raise RuntimeError("raw redis lost a value")

    tier = RedisTier(url, codec)
    items = list(zip(keys, chunks, strict=True))

    def tier_put() -> None:
        if not all(tier.put_many(items)):
            raise RuntimeError("redis tier refused a put")

    def tier_get() -> None:
        if any(c is None for c in tier.get_many(keys)):
            raise RuntimeError("redis tier lost an entry")

    t_raw_set, t_raw_get, t_put, t_get = _paired_times(
        [raw_set, raw_get, tier_put, tier_get], iters
    )
    client.delete(*raw_keys)
    for k in keys:
        tier.delete(k)
    tier.close()
    client.close()
    med = statistics.median
    return {
        "raw_set_gbps": nbytes / med(t_raw_set) / 1e9,
        "raw_get_gbps": nbytes / med(t_raw_get) / 1e9,
        "redis_put_gbps": nbytes / med(t_put) / 1e9,
        "redis_get_gbps": nbytes / med(t_get) / 1e9,
        "redis_vs_raw": _median_ratio(
            [s + g for s, g in zip(t_raw_set, t_raw_get, strict=True)],
            [p + g for p, g in zip(t_put, t_get, strict=True)],
        ),
    }


TARGETS = {"codec_vs_memcpy": 0.5, "redis_vs_raw": 0.8}
"""Goals of issue 15 at every budget (ratios, higher is better)."""


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    budgets = [r["budget"] for r in rows]
    x = list(range(len(budgets)))
    ratios: list[str] = [
        k for k in ("cpu_vs_memcpy", "codec_vs_memcpy", "redis_vs_raw") if k in rows[0]
    ]
    width = 0.8 / len(ratios)
    for i, key in enumerate(ratios):
        left.bar(
            [j + (i - (len(ratios) - 1) / 2) * width for j in x],
            [r[key] for r in rows],
            width,
            label=key,
        )
    for name, goal in TARGETS.items():
        if name in ratios:
            left.axhline(goal, linestyle="--", linewidth=1, color="gray")
            left.annotate(f"{name} goal", (len(x) - 0.5, goal), fontsize=7, ha="right", va="bottom")
    left.set_xticks(x, [str(b) for b in budgets])
    left.set_xlabel("kept fraction (budget)")
    left.set_ylabel("baseline time / store time")
    left.set_title("store vs baselines (median of paired repeats)")
    left.legend(fontsize=8)
    speeds: list[str] = [
        k
        for k in (
            "memcpy_gbps",
            "encode_gbps",
            "decode_gbps",
            "raw_set_gbps",
            "redis_put_gbps",
            "raw_get_gbps",
            "redis_get_gbps",
        )
        if k in rows[0]
    ]
    for speed in speeds:
        right.plot(budgets, [r[speed] for r in rows], marker="o", label=speed)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("kept fraction (budget)")
    right.set_ylabel("GB/s of payload")
    right.set_title("throughput")
    right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from lmcompact.store.redis_process import RedisProcess

    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise SystemExit(f"--budgets must be fractions in (0, 1], got {args.budgets!r}")
    torch.manual_seed(0)
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    server: RedisProcess | None = None
    redis_url = args.redis_url
    if redis_url is None and not args.no_redis:
        try:
            server = RedisProcess().start()
            redis_url = server.url
        except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
            logger.warning("no Redis measurements: %s", exc)
    rows = []
    try:
        with tqdm(total=5 * len(budgets), desc="bench store", unit="stage") as bar:
            for budget in budgets:
                rows.append(_bench_budget(args, budget, redis_url, lambda: bar.update(1)))
    finally:
        if server is not None:
            server.stop()

    full = rows[0]
    result: dict[str, Any] = {
        "benchmark": NAME,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "threads": torch.get_num_threads(),
        },
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "cpu_vs_memcpy": full["cpu_vs_memcpy"],
        "gpu_vs_memcpy": full["gpu_vs_memcpy"],
        "codec_vs_memcpy": full["codec_vs_memcpy"],
        "redis_vs_raw": full.get("redis_vs_raw"),
        "targets": TARGETS,
        "min_over_budgets": {
            k: min(r[k] for r in rows if k in r)
            for k in ("cpu_vs_memcpy", "gpu_vs_memcpy", "codec_vs_memcpy", "redis_vs_raw")
            if any(k in r for r in rows)
        },
        "rows": rows,
        "note": "ratios = baseline time / tier time over the same bytes, same run; "
        "memory-tier gets return views (zero copy), puts copy once",
    }
    write_json(args.json, result)
    if args.json not in (None, "-") or args.plot:
        _plot(Path(args.plot) if args.plot else Path(args.json).with_suffix(".png"), rows)
    cols = [
        "budget",
        "chunk_mib",
        "memcpy_gbps",
        "cpu_put_gbps",
        "cpu_get_gbps",
        "cpu_vs_memcpy",
        "encode_gbps",
        "decode_gbps",
        "codec_vs_memcpy",
    ]
    if redis_url is not None:
        cols += ["raw_set_gbps", "raw_get_gbps", "redis_put_gbps", "redis_get_gbps", "redis_vs_raw"]
    print(format_table(rows, cols))
    return 0
