"""``lmcompact bench pd``: prefill/decode disaggregation through a shared Redis cluster.

Per store configuration (policy ``none``, then each ``--budgets`` value on the default
stored-prefix path), a ``kv_producer`` and a ``kv_consumer`` ``vllm serve`` share a private
3-node Redis Cluster on loopback. Every request goes as a router sends it
(``examples/pd_proxy.py``): to the producer with ``max_tokens`` 1, then with the producer's
``kv_transfer_params`` to the consumer, whose answer is streamed to time its first token.
A plain ``vllm serve`` (no connector) answers the same prompts: the consumer that recomputes.

Reported per configuration: the consumer's store hits, bytes its loads moved per request
(``loaded_bytes``; ``bytes_ratio`` against policy ``none``), its time to first token against
the recomputing consumer, and the needle answers (natural-text haystack, 4 needles, several
questions per context) against the full cache's.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import platform
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcompact.bench.scratch_cluster import scratch_redis_cluster
from lmcompact.bench.serve_instance import ServeInstance, connector_transfer, started
from lmcompact.results import format_table, write_json

logger = logging.getLogger(__name__)

NAME = "pd"
HELP = "prefill/decode disaggregation: bytes moved and consumer TTFT, compacted vs policy none"
CHUNK = 256
DEPTHS = (0.1, 0.35, 0.65, 0.9)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--budgets", default="0.5,0.25", help="kept fractions to compare")
    parser.add_argument("--contexts", type=int, default=3, help="contexts (haystack seeds)")
    parser.add_argument("--questions", type=int, default=2, help="questions per context")
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", default=None, help="write the result here ('-': stdout)")
    parser.add_argument("--plot", default=None, help="PNG path (default: beside --json)")
    parser.add_argument("--logs", default=None, help="folder for the servers' logs")


def _prompts(model: str, args: argparse.Namespace) -> list[tuple[list[int], str]]:
    """(prompt ids, passkey asked) per question: natural text, several needles per context."""
    from transformers import AutoTokenizer

    from lmcompact.eval.tasks import build_needle_prompt
    from lmcompact.eval.text import haystack_text

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for seed in range(args.contexts):
        text = haystack_text("pydoc", seed)
        for ask in range(args.questions):
            sample = build_needle_prompt(
                tokenizer, args.context_tokens, seed, DEPTHS, ask % len(DEPTHS), "pydoc",
                "chat", text,
            )  # fmt: skip
            out.append((sample.input_ids, sample.target.passkey))
    return out


def _options(budget: float | None, redis_url: str) -> dict[str, Any]:
    store = {"chunk_size": CHUNK, "tiers": ["cpu", "redis"], "redis_url": redis_url}
    if budget is None:
        return {"policy": "none", "store": store}
    return {"budget": budget, "store": store}


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _answers(
    ask: Callable[[dict[str, Any]], tuple[float, str]], prompts: list[tuple[list[int], str]],
    args: argparse.Namespace, bar: Any,
) -> dict[str, Any]:  # fmt: skip
    """Every prompt through ``ask`` (a request body -> seconds to the first token, text):
    TTFT median and mean, accuracy, answers."""
    from lmcompact.eval.tasks import score_needle

    ttfts, answers, scores = [], [], []
    for ids, passkey in prompts:
        ttft, text = ask({"prompt": ids, "max_tokens": args.max_tokens, "temperature": 0})
        ttfts.append(ttft)
        answers.append(text)
        scores.append(score_needle(text, passkey))
        bar.update(1)
    return {
        "ttft_s": statistics.median(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "accuracy": statistics.fmean(scores),
        "answers": answers,
    }


def _run_pair(
    model: str, budget: float | None, redis_url: str, prompts: list[tuple[list[int], str]],
    args: argparse.Namespace, logs: Path, bar: Any,
) -> dict[str, Any]:  # fmt: skip
    """One producer + consumer pair over every prompt, as a router sends them."""
    label = "none" if budget is None else f"{budget:g}"
    extra = _options(budget, redis_url)
    producer, consumer = (
        ServeInstance(
            model, connector_transfer(extra, f"kv_{role}"), logs / f"{role}-{label}.log",
            max_model_len=args.context_tokens + 512,
        )
        for role in ("producer", "consumer")
    )  # fmt: skip

    def disaggregated(body: dict[str, Any]) -> tuple[float, str]:
        stored = producer.complete({**body, "max_tokens": 1}).get("kv_transfer_params")
        return consumer.first_token({**body, "kv_transfer_params": stored})

    with started([producer, consumer]):
        made0, used0 = producer.counters(), consumer.counters()
        answered = _answers(disaggregated, prompts, args, bar)
        made, used = producer.counters(), consumer.counters()
    n = len(prompts)
    return {
        "budget": label,
        "requests": n,
        "consumer_hits": int(_delta(used, used0, "store_hits")),
        "consumer_loaded_chunks": int(_delta(used, used0, "loaded_chunks")),
        "consumer_load_failures": int(_delta(used, used0, "load_failures")),
        "remote_waits": int(_delta(used, used0, "remote_waits")),
        "remote_wait_timeouts": int(_delta(used, used0, "remote_wait_timeouts")),
        "bytes_per_request": _delta(used, used0, "loaded_bytes") / n,
        "stored_bytes": _delta(made, made0, "stored_bytes"),
        "stored_full_bytes": _delta(made, made0, "stored_full_bytes"),
        **answered,
    }


def _recompute(
    model: str, prompts: list[tuple[list[int], str]], args: argparse.Namespace, logs: Path,
    bar: Any,
) -> dict[str, Any]:  # fmt: skip
    """The consumer without a producer: a plain vLLM computing every prompt."""
    plain = ServeInstance(
        model, None, logs / "recompute.log", max_model_len=args.context_tokens + 512
    )
    with started([plain]):
        answered = _answers(plain.first_token, prompts, args, bar)
    return {"budget": "recompute", "requests": len(prompts), **answered}


def _plot(path: Path, rows: list[dict[str, Any]], recompute: dict[str, Any]) -> None:
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed: no PNG at %s", path)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["budget"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(labels, [r["bytes_per_request"] / 2**20 for r in rows], color="tab:blue")
    left.set(xlabel="store budget", ylabel="MiB loaded per request", title="bytes moved")
    right.bar([*labels, "recompute"], [*(r["ttft_s"] for r in rows), recompute["ttft_s"]],
              color=["tab:blue"] * len(rows) + ["tab:gray"])  # fmt: skip
    right.set(xlabel="consumer", ylabel="median TTFT (s)", title="consumer time to first token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if any(not 0 < b < 1 for b in budgets):
        raise SystemExit(f"--budgets must be fractions in (0, 1), got {args.budgets!r}")
    if args.contexts < 1 or args.questions < 1:
        raise SystemExit("--contexts and --questions must be >= 1")
    if args.model is None:
        from lmcompact.hf.prepare import prepare_model

        args.model = str(prepare_model("smollm2"))
    prompts = _prompts(args.model, args)
    scratch = contextlib.ExitStack()
    logs = (
        Path(args.logs) if args.logs else Path(scratch.enter_context(tempfile.TemporaryDirectory()))
    )
    configs: list[float | None] = [None, *budgets]
    with (
        scratch,
        scratch_redis_cluster(3) as redis_url,
        tqdm(total=len(prompts) * (len(configs) + 1), desc="bench pd", unit="request") as bar,
    ):
        recompute = _recompute(args.model, prompts, args, logs, bar)
        rows = [_run_pair(args.model, b, redis_url, prompts, args, logs, bar) for b in configs]
    base = rows[0]
    full_answers = recompute["answers"]
    for row in rows:
        row["bytes_ratio"] = row["bytes_per_request"] / base["bytes_per_request"]
        row["ttft_vs_recompute"] = row["ttft_s"] / recompute["ttft_s"]
        row["same_answers_as_full"] = sum(
            a == b for a, b in zip(row["answers"], full_answers, strict=True)
        )
    result = {
        "benchmark": NAME,
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "func"},
        "bytes_ratio": {r["budget"]: r["bytes_ratio"] for r in rows[1:]},
        "consumer_hits": {r["budget"]: r["consumer_hits"] for r in rows},
        "ttft_vs_recompute": {r["budget"]: r["ttft_vs_recompute"] for r in rows},
        "rows": rows,
        "recompute": recompute,
        "note": "bytes = what the consumer's loads read from the store per request "
        "(loaded_bytes); TTFT = first streamed token on the consumer, after the producer "
        "answered; recompute = plain vLLM computing the prompt",
    }
    write_json(args.json, result)
    if args.json not in (None, "-") or args.plot:
        _plot(Path(args.plot) if args.plot else Path(args.json).with_suffix(".png"), rows,
              recompute)  # fmt: skip
    columns = ["budget", "consumer_hits", "bytes_per_request", "bytes_ratio", "ttft_s",
               "ttft_vs_recompute", "accuracy", "same_answers_as_full"]  # fmt: skip
    print(format_table([*rows, recompute], columns))
    return 0
