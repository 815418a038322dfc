"""``lmcompact bench capacity``: requests served at once from a fixed KV pool, with and
without in-place compaction.

Real vLLM on the CPU (in-process engine, float32, SmolLM2-135M by default). The same set
of needle-in-a-haystack chat requests arrives at once into an engine whose KV pool is
fixed (``num_gpu_blocks_override``), once with plain vLLM (baseline) and once per budget
with ``LMCompactConnector``'s release group (policy packed in place at prefill end; dropped blocks
go back to the pool). Every run is a fresh subprocess. Reported per run: the peak number of
requests running at once, decode throughput (tokens per second over steps that only
decode), end-to-end output tokens per second, and needle accuracy of the same requests.
Ratios are taken against the baseline of the same invocation::

    concurrency_ratio[b] = peak_running(b) / peak_running(baseline)
    throughput_ratio[b]  = decode_tokens_per_s(b) / decode_tokens_per_s(baseline)

Goal from the issue: concurrency_ratio >= 0.8 / budget.
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import Any

from lmcompact.bench.child import child_main
from lmcompact.bench.sweep import bench_command, budget_plans, parse_budgets, publish, run_plans
from lmcompact.results import format_table

NAME = "capacity"
HELP = "fixed KV pool, many long-context requests: concurrency, decode throughput, needle"

QUICK = {"requests": 16, "context": 512, "new_tokens": 16, "pool_requests": 4}
FULL = {"requests": 24, "context": 1024, "new_tokens": 16, "pool_requests": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="16 requests of ~512 tokens (a few minutes on 2 cores)"
    )
    parser.add_argument("--budgets", default="0.5,0.25", help="kept fractions to compare")
    parser.add_argument("--policy", default="snapkv", help="compaction policy (default snapkv)")
    parser.add_argument("--requests", type=int, default=None, help="requests sent at once")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated each")
    parser.add_argument(
        "--pool-requests",
        type=int,
        default=None,
        help="pool size in full-length requests (sets the block count)",
    )
    parser.add_argument("--model", default=None, help="model folder (default SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", help="model/KV dtype (GPU: bfloat16)")
    parser.add_argument(
        "--load-format",
        default="auto",
        help="vLLM load format; 'dummy' = random weights (serving shape only)",
    )
    parser.add_argument("--json", default=None, help="write results here ('-' for stdout)")
    parser.add_argument("--plot", default=None, help="PNG path (default: beside --json)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run, JSON spec


def _settings(args: argparse.Namespace) -> dict[str, int]:
    base = dict(QUICK if args.quick else FULL)
    for key, value in (
        ("requests", args.requests),
        ("context", args.context),
        ("new_tokens", args.new_tokens),
        ("pool_requests", args.pool_requests),
    ):
        if value is not None:
            if value < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
            base[key] = value
    return base


def _child(spec_path: str) -> int:
    def run_one(workload: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
        from lmcompact.bench.workload import Workload, run_workload

        return run_workload(Workload(**workload), extra)

    return child_main(spec_path, run_one)


def _plot(path: Path, runs: dict[str, dict[str, Any]], summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        left.plot(run["trace"]["running"], label=name)
    left.set_xlabel("engine step")
    left.set_ylabel("requests running")
    left.set_title("requests running at once (fixed KV pool)")
    left.legend()
    budgets = list(summary["concurrency_ratio"])
    x = range(len(budgets))
    right.bar(
        [i - 0.2 for i in x],
        [summary["concurrency_ratio"][b] for b in budgets],
        0.4,
        label="concurrency ratio",
    )
    right.bar(
        [i + 0.2 for i in x],
        [summary["throughput_ratio"][b] for b in budgets],
        0.4,
        label="decode throughput ratio",
    )
    right.plot(
        [i for i in x],
        [0.8 / float(b) for b in budgets],
        "k_",
        markersize=30,
        label="goal 0.8 / budget",
    )
    right.set_xticks(list(x), [f"budget {b}" for b in budgets])
    right.set_ylabel("vs baseline")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.child:
        return _child(args.child)
    settings = _settings(args)
    budgets = parse_budgets(args.budgets)
    if args.model is None:
        from lmcompact.hf.prepare import prepare_model

        model = str(prepare_model("smollm2"))
    else:
        model = args.model
    block = 32
    full_blocks = -(-(settings["context"] + settings["new_tokens"] + 64) // block)
    workload = {
        "model": model,
        "num_requests": settings["requests"],
        "context_tokens": settings["context"],
        "new_tokens": settings["new_tokens"],
        "num_blocks": settings["pool_requests"] * full_blocks + 1,
        "block_size": block,
        "max_num_seqs": settings["requests"],
        "max_num_batched_tokens": max(512, settings["context"]),
        "dtype": args.dtype,
        "load_format": args.load_format,
    }
    memory = {"prefill": "pack"}
    runs = run_plans("capacity", workload, budget_plans(args.policy, budgets, 32, memory))

    base = runs["baseline"]
    summary: dict[str, Any] = {
        "concurrency_ratio": {b: runs[b]["peak_running"] / base["peak_running"] for b in budgets},
        "throughput_ratio": {
            b: runs[b]["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            if base["decode_tokens_per_s"]
            else 0.0
            for b in budgets
        },
        "end_to_end_ratio": {
            b: runs[b]["output_tokens_per_s"] / base["output_tokens_per_s"] for b in budgets
        },
        "needle_accuracy": {name: r["needle_accuracy"] for name, r in runs.items()},
    }
    summary["goal_concurrency_met"] = {
        b: summary["concurrency_ratio"][b] >= 0.8 / float(b) for b in budgets
    }
    rows = [
        {
            "run": name,
            "peak_running": r["peak_running"],
            "decode_tok_s": r["decode_tokens_per_s"],
            "output_tok_s": r["output_tokens_per_s"],
            "needle": f"{r['needle_correct']}/{r['workload']['num_requests']}",
            "steps": r["steps"],
            "wall_s": r["wall_s"],
            "pool_ok": r["free_blocks_end"] == r["free_blocks_start"],
            "pack_s": (r["memory"] or {}).get("pack_seconds", 0.0),
        }
        for name, r in runs.items()
    ]
    print(format_table(rows))
    print(
        format_table(
            [
                {
                    "budget": b,
                    "concurrency_ratio": summary["concurrency_ratio"][b],
                    "throughput_ratio": summary["throughput_ratio"][b],
                    "end_to_end_ratio": summary["end_to_end_ratio"][b],
                    "goal (0.8/budget)": 0.8 / float(b),
                }
                for b in budgets
            ]
        )
    )
    payload = {
        "command": bench_command("capacity"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        },
        "policy": args.policy,
        "settings": {
            **settings,
            "num_blocks": workload["num_blocks"],
            "block_size": block,
            "full_request_blocks": full_blocks,
        },
        **summary,
        "runs": runs,
    }
    publish(args, payload, lambda path: _plot(path, runs, summary))
    return 0
