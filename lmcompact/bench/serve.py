"""``lmcompact bench serve``: end-to-end serving with and without compaction, as users run vLLM.

CUDA graphs on (vLLM's default compilation; the CPU build is eager), vLLM's default
batching, a KV pool given in full requests (``--pool-requests``) or by
``--gpu-memory-utilization``. One workload = ``--requests`` prompts of ``--prompt-tokens``
random token ids arriving at once, each generating exactly ``--output-tokens``. The
baseline (plain vLLM) and one run per budget (the connector's release group, policy packed
in place at prefill end) run in fresh subprocesses of one invocation::

    e2e_ratio[b]    = output_tok_s(b) / output_tok_s(baseline)       (wall clock, all work)
    decode_ratio[b] = decode_tok_s(b) / decode_tok_s(baseline)       (decode-only steps)

``--quick`` runs on the CPU with SmolLM2 in a few minutes. ``--tensor-parallel-size N``
splits the model across N GPUs (CPU: N worker processes) with vLLM's ``mp`` executor. For a
serving shape without weights, ``--shape llama3-8b`` writes a config folder (Llama-3-8B:
32 layers, 32 query / 8 KV heads, head_dim 128) and loads random weights
(``load_format="dummy"``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

from lmcompact.bench.child import child_main
from lmcompact.bench.shapes import LLAMA_SHAPES
from lmcompact.bench.sweep import (
    Plan,
    bench_command,
    budget_plans,
    parse_budgets,
    publish,
    run_plans,
)
from lmcompact.results import format_table

NAME = "serve"
HELP = "end-to-end serving (CUDA graphs, default batching): baseline vs compaction budgets"

QUICK = {"prompt_tokens": 1024, "output_tokens": 64, "requests": 12, "pool_requests": 3}
FULL = {"prompt_tokens": 16384, "output_tokens": 1024, "requests": 24, "pool_requests": 6}
SHAPES = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **LLAMA_SHAPES["8b"],
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    }
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="CPU, SmolLM2, minutes")
    parser.add_argument("--budgets", default="0.25", help="kept fractions, comma separated")
    parser.add_argument("--policy", default="snapkv", help="compaction policy (default snapkv)")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="requests sent at once")
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--pool-requests", type=int, default=None, help="KV pool in full requests")
    pool.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="size the pool as vLLM does"
    )
    parser.add_argument("--model", default=None, help="model folder (default SmolLM2-135M)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="dummy-weight shape")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--window", type=int, default=32, help="observation window queries")
    parser.add_argument("--no-reserve", action="store_true", help="admission without reserve")
    parser.add_argument("--no-warm-up", action="store_true", help="skip start-up warm-up")
    parser.add_argument(
        "--decode-budget-tokens",
        type=int,
        default=None,
        help="release.decode_budget_tokens: full-block tokens a request may hold outside its "
        "hole during generation, its kept prompt included (long generation); None: unbounded",
    )
    parser.add_argument(
        "--protect-prompt",
        action="store_true",
        help="release.protect_prompt: the decode budget counts generated tokens only",
    )
    parser.add_argument(
        "--decode-policy",
        default=None,
        help="release.decode_policy with --decode-budget-tokens (default: the connector's)",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA graphs off")
    parser.add_argument(
        "--cuda-graphs",
        choices=("auto", "piecewise", "full"),
        default="auto",
        help="the connector's cuda_graphs option for the compacted runs (default: its own)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs (CPU: processes) the model is split across; its KV heads must divide by it",
    )
    parser.add_argument(
        "--per-head-policy",
        default=None,
        help="also run this per-head policy (e.g. adakv) at each budget, in place with "
        "release.per_head (dense cells), against --policy in the same invocation",
    )
    parser.add_argument(
        "--per-head-slack",
        type=float,
        default=1.5,
        help="release.per_head slack of the --per-head-policy runs (default 1.5)",
    )
    parser.add_argument("--json", default=None, help="write results here ('-' for stdout)")
    parser.add_argument("--plot", default=None, help="PNG path (default: beside --json)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    base: dict[str, Any] = dict(QUICK if args.quick else FULL)
    for key in ("prompt_tokens", "output_tokens", "requests", "pool_requests"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
            base[key] = value
    if args.gpu_memory_utilization is not None:
        if not 0.0 < args.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
            )
        base["pool_requests"] = None
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    base["tensor_parallel_size"] = args.tensor_parallel_size
    return base


def shape_folder(shape: str, root: Path) -> Path:
    """A config-only model folder of ``shape`` (load it with ``load_format="dummy"``)."""
    folder = root / shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    return folder


def _child(spec_path: str) -> int:
    def run_one(workload: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
        from lmcompact.bench.serve_run import ServeWorkload, run_serve

        return run_serve(ServeWorkload(**workload), extra)

    return child_main(spec_path, run_one)


def _plot(path: Path, runs: dict[str, dict[str, Any]], summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        steps = run["trace"]["step_s"]
        clock = [sum(steps[: i + 1]) for i in range(len(steps))]
        left.plot(clock, run["trace"]["running"][: len(clock)], label=name)
    left.set_xlabel("wall clock (s)")
    left.set_ylabel("requests running")
    left.set_title("requests running (fixed KV pool)")
    left.legend()
    budgets = list(summary["e2e_ratio"])
    x = range(len(budgets))
    right.bar([i - 0.2 for i in x], [summary["e2e_ratio"][b] for b in budgets], 0.4, label="e2e")
    right.bar(
        [i + 0.2 for i in x], [summary["decode_ratio"][b] for b in budgets], 0.4, label="decode"
    )
    right.axhline(1.0, color="k", lw=0.8)
    right.set_xticks(list(x), [b if " " in b else f"budget {b}" for b in budgets])
    right.set_ylabel("throughput vs baseline")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def per_head_name(budget: str, policy: str) -> str:
    """The plan name of ``policy``'s per-head run at ``budget``."""
    return f"{budget} {policy} per-head"


def per_head_plans(
    policy: str,
    slack: float,
    budgets: list[str],
    window: int,
    memory: dict[str, Any],
    options: dict[str, Any],
) -> list[Plan]:
    """``policy`` packed in place with per-head counts (``release.per_head``, dense cells at
    the default layer slack) at each budget, named by :func:`per_head_name`."""
    per_head = {**memory, "per_head": {"slack": slack}}
    plans = budget_plans(policy, budgets, window, per_head, options)[1:]  # no second baseline
    return [(per_head_name(b, policy), extra) for b, (_, extra) in zip(budgets, plans, strict=True)]


def _row(name: str, r: dict[str, Any]) -> dict[str, Any]:
    m = r["memory"] or {}
    return {
        "run": name,
        "wall_s": r["wall_s"],
        "out_tok_s": r["output_tokens_per_s"],
        "decode_tok_s": r["decode_tokens_per_s"],
        "peak_run": r["peak_running"],
        "mean_run": r["mean_running"],
        "preempt": r["preemptions"],
        "packs": m.get("packs", "-"),
        "repacks": m.get("repacks", "-"),
        "pack_ms_p50": m.get("pack_ms_p50", "-"),
        "pack_ms_p99": m.get("pack_ms_p99", "-"),
        "first_pack_ms": m.get("pack_ms_first", "-"),
        "init_s": r["engine_init_s"],
    }


def run(args: argparse.Namespace) -> int:
    if args.child:
        return _child(args.child)
    settings = _settings(args)
    budgets = parse_budgets(args.budgets)
    import torch

    on_cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    bs = args.block_size
    full_blocks = -(-(settings["prompt_tokens"] + settings["output_tokens"]) // bs)
    with tempfile.TemporaryDirectory(prefix="lmc-serve-") as scratch:
        load_format = "auto"
        if args.shape is not None:
            model = str(shape_folder(args.shape, Path(scratch)))
            load_format = "dummy"
        elif args.model is not None:
            model = args.model
        else:
            from lmcompact.hf.prepare import prepare_model

            model = str(prepare_model("smollm2"))
        pool = settings["pool_requests"]
        workload = {
            "model": model,
            "prompt_tokens": settings["prompt_tokens"],
            "output_tokens": settings["output_tokens"],
            "num_requests": settings["requests"],
            "block_size": bs,
            "num_blocks": None if pool is None else pool * full_blocks + 1,
            "gpu_memory_utilization": args.gpu_memory_utilization or 0.9,
            "dtype": dtype,
            "load_format": load_format,
            "enforce_eager": args.enforce_eager,
            "tensor_parallel_size": settings["tensor_parallel_size"],
        }
        memory = {
            "prefill": "pack",
            "reserve_growth": not args.no_reserve,
            "warm_up": not args.no_warm_up,
        }
        if args.decode_budget_tokens is not None:
            memory["decode_budget_tokens"] = args.decode_budget_tokens
            if args.decode_policy is not None:
                memory["decode_policy"] = args.decode_policy
            if args.protect_prompt:
                memory["protect_prompt"] = True
        elif args.decode_policy is not None or args.protect_prompt:
            raise ValueError("--decode-policy and --protect-prompt need --decode-budget-tokens")

        def show(name: str, result: dict[str, Any]) -> None:
            print(format_table([_row(name, result)]), file=sys.stderr, flush=True)

        options = {"cuda_graphs": args.cuda_graphs}
        plans = budget_plans(args.policy, budgets, args.window, memory, options)
        if args.per_head_policy is not None:
            plans += per_head_plans(
                args.per_head_policy, args.per_head_slack, budgets, args.window, memory, options
            )
        runs = run_plans("serve", workload, plans, Path(scratch), show)

    base = runs["baseline"]

    def ratio(key: str, b: str) -> float:
        return runs[b][key] / base[key] if base[key] else 0.0

    names = [name for name, _ in plans if name != "baseline"]
    summary: dict[str, Any] = {
        "e2e_ratio": {b: ratio("output_tokens_per_s", b) for b in names},
        "decode_ratio": {b: ratio("decode_tokens_per_s", b) for b in names},
        "peak_running_ratio": {b: ratio("peak_running", b) for b in names},
        "pack_ms_p50": {b: (runs[b]["memory"] or {}).get("pack_ms_p50") for b in names},
        "pack_ms_first": {b: (runs[b]["memory"] or {}).get("pack_ms_first") for b in names},
        "preemptions": {name: r["preemptions"] for name, r in runs.items()},
    }
    if args.per_head_policy is not None:  # the per-head run's e2e over the uniform one's
        summary["per_head_vs_uniform_e2e"] = {
            b: summary["e2e_ratio"][per_head_name(b, args.per_head_policy)]
            / summary["e2e_ratio"][b]
            for b in budgets
            if summary["e2e_ratio"][b]
        }
    print(format_table([_row(name, r) for name, r in runs.items()]))
    print(
        format_table(
            [
                {
                    "run": b,
                    "e2e_ratio": summary["e2e_ratio"][b],
                    "decode_ratio": summary["decode_ratio"][b],
                }
                for b in names
            ]
        )
    )
    payload = {
        "command": bench_command("serve"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if on_cuda else None,
            "cpus": os.cpu_count(),
        },
        "policy": args.policy,
        "settings": {**settings, "block_size": bs, "full_request_blocks": full_blocks},
        **summary,
        "runs": runs,
    }
    from connectors.vllm.patches.engine import vllm_version

    payload["machine"]["vllm"] = vllm_version()
    publish(args, payload, lambda path: _plot(path, runs, summary))
    return 0
