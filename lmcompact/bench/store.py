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
  values' lengths, on the same server and connection pool settings. On a cluster
  (``--redis-cluster N`` or a ``redis+cluster://`` URL) the baseline is redis-py's
  ``RedisCluster`` pipeline, and each raw key carries its tier key as hash tag, so both
  sides put the same bytes on the same nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lmcompact.bench.scratch_cluster import scratch_redis_cluster
from lmcompact.bench.store_cases import BudgetCase
from lmcompact.bench.store_cuda import STEPS as CUDA_STEPS
from lmcompact.results import format_table, write_json
from lmcompact.store.chunk import SUPPORTED_DTYPES

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
        "--redis-url",
        default=None,
        help="Redis to use (redis://, or redis+cluster://host:port,... for a cluster); "
        "default: start a private redis-server",
    )
    parser.add_argument(
        "--redis-cluster",
        type=int,
        default=0,
        metavar="N",
        help="start a private Redis Cluster of N (>= 3) primaries on loopback and measure "
        "the tier on it, against redis-py's RedisCluster pipeline",
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


@contextlib.contextmanager
def scratch_redis_server(timeout_s: float = 10.0) -> Iterator[str]:
    """A throwaway ``redis-server`` on a free 127.0.0.1 port (no persistence, its files in a
    temporary folder); yields its URL and stops it by PID on exit.

    The Redis rows measure a real server: without ``--redis-url`` the benchmark starts its
    own. FileNotFoundError without ``redis-server`` on PATH; RuntimeError when it exits at
    once; TimeoutError when it does not answer PING within ``timeout_s``.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server not found on PATH (apt-get install redis-server)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="lmc-bench-redis-") as folder:
        command = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                   "--appendonly", "no", "--dir", folder]  # fmt: skip
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout_s
            while not _answers_ping(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {port} did not answer PING")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _redact_url(url: str) -> str:
    """``url`` without its password (the JSON records which Redis was measured)."""
    head, at, hosts = url.rpartition("@")
    return f"{head.split('://')[0]}://***@{hosts}" if at else url


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise SystemExit(f"--budgets must be fractions in (0, 1], got {args.budgets!r}")
    torch.manual_seed(0)
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    if args.redis_cluster and (args.redis_cluster < 3 or args.redis_url is not None):
        raise SystemExit(
            f"--redis-cluster takes N >= 3 and no --redis-url, got {args.redis_cluster}"
        )
    if args.iters < 1 or args.repeats < 1:
        raise SystemExit(f"--iters and --repeats must be >= 1, got {args.iters}, {args.repeats}")
    scratch = contextlib.ExitStack()  # the private redis-server, when one is started
    redis_url = args.redis_url
    if redis_url is None and not args.no_redis:
        try:
            redis_url = scratch.enter_context(
                scratch_redis_cluster(args.redis_cluster)
                if args.redis_cluster
                else scratch_redis_server()
            )
        except (FileNotFoundError, RuntimeError, TimeoutError, OSError) as exc:
            logger.warning("no Redis measurements: %s", exc)
    cases: list[BudgetCase] = []
    try:
        cases = [BudgetCase(args, budget, redis_url) for budget in budgets]
        with tqdm(total=args.repeats * len(cases), desc="bench store", unit="pass") as bar:
            for _ in range(args.repeats):
                for case in cases:
                    case.measure(args.iters)
                    bar.update(1)
        rows = [case.row() for case in cases]
    finally:
        for case in cases:
            case.close()
        scratch.close()

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
        "redis": None if redis_url is None else _redact_url(redis_url),
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
