"""``lmcompact bench store``: throughput of the store tiers and codec against baselines.

Chunks are the size SmolLM2-135M produces (256 tokens x 30 layers x 3 kv heads x 64 dims,
K and V in bf16: 5.6 MiB) and their compacted sizes at budgets 0.5 and 0.25. Every tier is
measured against a baseline run in the same process on the same bytes:

* CPU / GPU tier put+get  vs  ``torch`` copy of the same bytes into a preallocated buffer;
* codec encode+decode     vs  the same copy;
* Redis tier put+get      vs  raw redis-py pipelined SET+GET of equal-sized byte values.

Each timed round runs every baseline and every measured path once, back to back, on the
same bytes; a ratio is the median baseline time over the median measured time (1.0 = as
fast as the baseline; a path made of two steps, e.g. encode + decode, takes the sum of the
steps' medians). Rounds come in ``--repeats`` passes over all budgets (``--iters`` rounds
per budget each pass), so a burst of load from other processes on a shared host spreads
over budgets and both sides of every ratio instead of spoiling one. Throughputs (GB/s) are
payload bytes over the median time. ``*_best`` ratios use each step's fastest round
instead (on a heavily shared host the medians carry other processes' load). The JSON keeps
every round's times (``times_s``).

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

from lmcompact.bench.store_cuda import STEPS as CUDA_STEPS
from lmcompact.bench.store_cuda import CudaCase, cuda_row
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
    parser.add_argument("--iters", type=int, default=5, help="timed rounds per budget and pass")
    parser.add_argument(
        "--repeats", type=int, default=5, help="passes over all budgets (medians pool all rounds)"
    )
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
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: also time host <-> GPU moves of the chunks (pinned CPU tier saves, GPU "
        "tier loads) against plain copies and the host memcpy",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for tiers and baselines alike (on a busy shared host, "
        "more than one makes every copy wait for a descheduled worker)",
    )


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


class _BudgetCase:
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

        from lmcompact.store.tiers.redis_tier import RedisTier

        self.client = redis.Redis.from_url(url)
        self.raw_keys = [f"lmc-bench-raw:{i}".encode() for i in range(len(chunks))]
        self.raw_values = [bytes(len(codec.encode(c))) for c in chunks]
        self.tier = RedisTier(url, codec)
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


TARGETS = {"codec_vs_memcpy": 0.5, "redis_vs_raw": 0.8}
"""Goals of issue 15 at every budget (ratios, higher is better)."""


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    try:
        import matplotlib
    except ImportError:  # e.g. the GPU machine: the JSON is what counts
        logger.warning("matplotlib is not installed: no PNG at %s", path)
        return
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
    left.set_title("store vs baselines (medians of interleaved rounds)")
    left.legend(fontsize=8, loc="lower left")
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
    if args.iters < 1 or args.repeats < 1:
        raise SystemExit(f"--iters and --repeats must be >= 1, got {args.iters}, {args.repeats}")
    server: RedisProcess | None = None
    redis_url = args.redis_url
    if redis_url is None and not args.no_redis:
        try:
            server = RedisProcess().start()
            redis_url = server.url
        except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
            logger.warning("no Redis measurements: %s", exc)
    cases: list[_BudgetCase] = []
    try:
        cases = [_BudgetCase(args, budget, redis_url) for budget in budgets]
        with tqdm(total=args.repeats * len(cases), desc="bench store", unit="pass") as bar:
            for _ in range(args.repeats):
                for case in cases:
                    case.measure(args.iters)
                    bar.update(1)
        rows = [case.row() for case in cases]
    finally:
        for case in cases:
            case.close()
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
            for k in (
                "cpu_vs_memcpy",
                "gpu_vs_memcpy",
                "codec_vs_memcpy",
                "redis_vs_raw",
                "codec_vs_memcpy_best",
                "redis_vs_raw_best",
                "d2h_vs_raw",
                "h2d_vs_raw",
                "d2h_vs_memcpy",
                "h2d_vs_memcpy",
            )
            if any(k in r for r in rows)
        },
        "rows": rows,
        "note": "ratios = median baseline time / median store time over the same bytes, "
        "rounds interleaved in one run; memory-tier gets return views (zero copy), puts copy once",
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
    if args.device == "cuda":
        cols += [f"{s}_gbps" for s in CUDA_STEPS]
        cols += ["d2h_vs_raw", "h2d_vs_raw", "d2h_vs_memcpy", "h2d_vs_memcpy"]
    print(format_table(rows, cols))
    return 0
