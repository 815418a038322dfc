"""``lmcompact bench scores``: chunked window scores vs the eager full-matrix way.

For each T the same random queries/keys are scored twice: by
:func:`~lmcompact.attention.scores.window_scores` (O(W x chunk) extra memory)
and by :func:`~lmcompact.attention.scores.window_scores_naive` over the whole
prompt (the ``T x T`` matrix that ``output_attentions=True`` materializes).
Each measurement runs in a fresh subprocess so peak memory is that call's own:
on CPU the peak RSS growth of the process, on CUDA ``max_memory_allocated``.
The naive run is skipped where its matrix would not fit ``--naive-max-gib``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lmcompact.results import format_table, write_json

NAME = "scores"
HELP = "chunked observation-window scores vs eager full attention: time and peak memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths", default="4096,8192,16384,32768,65536", help="comma-separated prompt lengths T"
    )
    parser.add_argument("--window", type=int, default=64, help="observation window W")
    parser.add_argument("--q-heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=4096, help="keys per chunk")
    parser.add_argument(
        "--naive-max-gib",
        type=float,
        default=6.0,
        help="skip the naive run when its T x T matrices exceed this",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="write results here ('-' for stdout)")
    parser.add_argument("--plot", default=None, help="PNG path (default: beside --json)")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child mode


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _measure(spec: dict[str, Any]) -> dict[str, float]:
    """Child process: run one method once; time and peak memory growth incl. its inputs."""
    import torch

    from lmcompact.attention.scores import window_scores, window_scores_naive

    device = torch.device(spec["device"])
    t, w = spec["T"], spec["W"]
    g = torch.Generator(device="cpu").manual_seed(0)

    def inputs(length: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.randn(1, spec["kv_heads"], length, spec["head_dim"], generator=g)
        queries = torch.randn(1, spec["q_heads"], q_len, spec["head_dim"], generator=g)
        return queries.to(device), keys.to(device)

    # warm up thread pools and the allocator's workspace on a small problem, so
    # the peak below is what this T costs: inputs, output and live workspace
    window_scores(*inputs(spec["chunk"], w), chunk_size=spec["chunk"])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _current_rss()
    queries, keys = inputs(t, t if spec["method"] == "naive" else w)
    start = time.perf_counter()
    if spec["method"] == "naive":
        window_scores_naive(queries, keys)
    else:
        window_scores(queries, keys, chunk_size=spec["chunk"])
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_bytes()
    return {"time_s": elapsed, "peak_bytes": float(max(0, peak - base))}


def _run_child(spec: dict[str, Any]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "lmcompact", "bench", "scores", "--measure", json.dumps(spec)],
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _linear_fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys, strict=True))
    return {
        "bytes_per_token": slope,
        "intercept_bytes": intercept,
        "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0,
    }


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in ("chunked", "naive"):
        pts = [
            (r["T"], r[f"{method}_peak_bytes"] / 2**20)
            for r in rows
            if r[f"{method}_peak_bytes"] is not None
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length T")
    ax.set_ylabel("peak extra memory (MiB)")
    ax.set_title("observation-window scores: chunked vs full matrix")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.measure:
        print(json.dumps(_measure(json.loads(args.measure))))
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(t < args.window for t in lengths):
        raise ValueError(f"every length must be >= the window {args.window}, got {lengths}")
    common = {
        "W": args.window,
        "q_heads": args.q_heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "chunk": args.chunk,
        "device": args.device,
    }
    rows: list[dict[str, Any]] = []
    for t in tqdm(lengths, desc="bench scores"):
        chunked = _run_child({**common, "T": t, "method": "chunked"})
        # logits + probabilities, fp32, for every query head
        naive_gib = 2 * args.q_heads * t * t * 4 / 2**30
        naive = (
            _run_child({**common, "T": t, "method": "naive"})
            if naive_gib <= args.naive_max_gib
            else None
        )
        row: dict[str, Any] = {
            "T": t,
            "chunked_time_s": chunked["time_s"],
            "chunked_peak_bytes": chunked["peak_bytes"],
            "naive_time_s": naive["time_s"] if naive else None,
            "naive_peak_bytes": naive["peak_bytes"] if naive else None,
            "naive_skipped_gib": None if naive else naive_gib,
        }
        row["time_ratio_naive_over_chunked"] = (
            naive["time_s"] / chunked["time_s"] if naive else None
        )
        row["memory_ratio_naive_over_chunked"] = (
            naive["peak_bytes"] / max(chunked["peak_bytes"], 1.0) if naive else None
        )
        rows.append(row)
    fit = _linear_fit([float(r["T"]) for r in rows], [r["chunked_peak_bytes"] for r in rows])
    payload = {
        "benchmark": "scores",
        "config": {**common, "lengths": lengths},
        "results": rows,
        "chunked_memory_linear_fit": fit,
    }
    print(
        format_table(
            rows,
            [
                "T",
                "chunked_time_s",
                "naive_time_s",
                "time_ratio_naive_over_chunked",
                "chunked_peak_bytes",
                "naive_peak_bytes",
                "memory_ratio_naive_over_chunked",
            ],
        )
    )
    print(
        f"chunked peak memory vs T: {fit['bytes_per_token']:.1f} bytes/token, R^2 = {fit['r2']:.4f}"
    )
    write_json(args.json, payload)
    plot = args.plot or (
        str(Path(args.json).with_suffix(".png")) if args.json and args.json != "-" else None
    )
    if plot:
        _plot(rows, Path(plot))
    return 0
