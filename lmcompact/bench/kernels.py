"""``lmcompact bench kernels``: the Triton kernels against torch baselines on one GPU.

Every ratio compares timings taken in the same run (``triton.testing.do_bench``,
median). Bandwidth fractions divide achieved bytes/s (bytes read + written)
by the bandwidth of a large device-to-device copy measured at the start.

    window scores     kernel vs SDPA forward of the same window queries (no scores)
                      and vs the eager full-matrix way (``window_scores_naive``)
    ragged decode     per-head paged decode vs copy bandwidth and vs dense SDPA
                      over the same number of kept tokens
    compaction copy   packing kept tokens into a destination pool vs copy bandwidth
    defragmentation   blocks freed and time

The measurements live in :mod:`lmcompact.bench.kernel_rows`, the timing helpers in
:mod:`lmcompact.bench.gpu_timing`; this module is the command (arguments, goals, output).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from lmcompact.bench.gpu_timing import copy_bandwidth
from lmcompact.bench.kernel_rows import compaction_rows, decode_rows, window_row

NAME = "kernels"
HELP = "time the Triton kernels (window scores, paged attention, compaction) on CUDA"

log = logging.getLogger(__name__)

SWEEP_COLUMNS = (
    "T",
    "kernel_ms",
    "sdpa_ms",
    "eager_ms",
    "vs_sdpa",
    "vs_eager",
    "kernel_graph_ms",
    "sdpa_graph_ms",
)
GOALS = {
    "window_scores_vs_sdpa": ("<=", 1.5),
    "window_scores_vs_eager": (">=", 10.0),
    "ragged_decode_bw_fraction": (">=", 0.7),
    "ragged_decode_vs_dense_sdpa": ("<=", 1.2),
    "compaction_copy_bw_fraction": (">=", 0.7),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="write results as JSON here ('-' = stdout)")
    parser.add_argument("--plot", default=None, help="write a PNG of the T sweep here")
    parser.add_argument("--window", type=int, default=64, help="window queries W")
    parser.add_argument("--seq-len", type=int, default=32768, help="T of the headline scores")
    parser.add_argument(
        "--sweep",
        default="8192,16384,32768,65536,131072",
        help="comma-separated T values of the window-scores sweep",
    )
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-prefix", type=int, default=8192)
    parser.add_argument(
        "--variants", action="store_true", help="also time alternative tile configurations"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")


def _plot(path: str, sweep: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [r["T"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ts, [r["kernel_ms"] for r in sweep], "o-", label="window scores (Triton)")
    ax.plot(ts, [r["sdpa_ms"] for r in sweep], "s-", label="SDPA forward, no scores")
    if all("eager_ms" in r for r in sweep):
        ax.plot(ts, [r["eager_ms"] for r in sweep], "^-", label="eager full-matrix scores")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (keys)")
    ax.set_ylabel("ms (median)")
    ax.set_title("Window scores, W=64, 32 q heads / 8 kv heads, D=128, bf16")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _goals(metrics: dict[str, float]) -> dict[str, Any]:
    out = {}
    for name, (op, goal) in GOALS.items():
        value = metrics[name]
        met = value <= goal if op == "<=" else value >= goal
        out[name] = {"value": value, "goal": f"{op} {goal}", "met": bool(met)}
    return out


def run(args: argparse.Namespace) -> int:
    import sys

    import torch
    import triton

    from lmcompact.results import format_table, write_json

    if not torch.cuda.is_available():
        print("lmcompact bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.quick:
        args.seq_len, args.sweep = 4096, "2048,4096"
        args.decode_batch, args.decode_prefix = 4, 1024
    props = torch.cuda.get_device_properties(0)
    copy = copy_bandwidth(2 << 30 if not args.quick else 256 << 20)
    log.info("copy bandwidth %.0f GB/s", copy["GBps"])
    sweep_ts = sorted({int(x) for x in args.sweep.split(",")} | {args.seq_len})
    sweep = [window_row(t, args.window, args, eager=True) for t in sweep_ts]
    head = next(r for r in sweep if r["T"] == args.seq_len)
    decode = decode_rows(args, copy["GBps"])
    compaction = compaction_rows(args, copy["GBps"])
    metrics = {
        "window_scores_vs_sdpa": head["vs_sdpa"],
        "window_scores_vs_eager": head["vs_eager"],
        "ragged_decode_bw_fraction": decode["ragged"]["bw_fraction"],
        "ragged_decode_vs_dense_sdpa": decode["ragged"]["vs_dense_sdpa"],
        "compaction_copy_bw_fraction": compaction["compaction"]["bw_fraction"],
    }
    payload: dict[str, Any] = {
        "command": "lmcompact bench kernels " + " ".join(sys.argv[3:])
        if len(sys.argv) > 3
        else "lmcompact bench kernels",
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timing": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms)",
        **metrics,
        "goals": _goals(metrics),
        "copy_bandwidth": copy,
        "window_scores": head,
        "window_scores_sweep": sweep,
        "ragged_decode": decode,
        **compaction,
        "notes": {
            "window_scores_vs_sdpa": "SDPA gets the same (1, 32, W, 128) queries and "
            "(1, 8, T, 128) K and V with enable_gqa=True and no mask; the kernel returns "
            "scores only",
            "window_scores_vs_eager": "eager = lmcompact.attention.scores.window_scores_naive on "
            "the W window queries (fp32 full W x T matrix, softmax, sum)",
            "bytes": "bandwidth counts bytes read plus written: decode reads each visible K and "
            "V once; compaction reads and writes K and V of every moved token",
        },
    }
    print(format_table([{"metric": k, **v} for k, v in payload["goals"].items()]))
    print(format_table([{k: r.get(k) for k in SWEEP_COLUMNS} for r in sweep]))
    write_json(args.json, payload)
    if args.plot:
        _plot(args.plot, sweep)
    return 0
