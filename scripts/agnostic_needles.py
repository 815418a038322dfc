"""Multi-question needles through the vLLM save path: one request stores a context, then
one request per needle asks a different question and loads the stored (compacted) prefix.

    python scripts/agnostic_needles.py --context 2048 --samples 2 \
        --policies kvzip,expected_attention,snapkv,knorm,streaming_llm --budgets 0.5,0.25 \
        --json /tmp/agnostic.json

A policy may carry parameters: ``kvzip:repeat=false/max_queries=4096`` (``window=N`` sets
the connector's observation window).
Prints one row per (policy, budget): accuracy over samples x needles, store hits, and the
save-path compaction seconds; the full cache (no connector) is the first row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tests.integration.vllm.engine import engine, greedy, worker_connector
from tests.integration.vllm.shared_context import SharedContext, build_shared_context

MAX_TOKENS = 8


def run_cell(
    model: str,
    tokenizer: Any,
    contexts: list[SharedContext],
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    """Accuracy of every question of every context; the context is stored first."""
    correct = hits = asked = 0
    answers: list[str] = []
    began = time.perf_counter()
    with engine(model, extra, max_model_len=4608) as llm:
        connector = worker_connector()
        for ctx in contexts:
            if connector is not None:
                greedy(llm, ctx.context, 1)  # the request that stores the context
                connector.worker_half.drain()
            for index in range(len(ctx.needles)):
                before = connector.worker_half.stats["loaded_chunks"] if connector else 0
                out = tokenizer.decode(greedy(llm, ctx.prompt(index), MAX_TOKENS))
                if connector is not None:
                    connector.worker_half.drain()
                    hits += connector.worker_half.stats["loaded_chunks"] > before
                asked += 1
                correct += ctx.correct(index, out)
                answers.append(out)
        stats = dict(connector.worker_half.stats) if connector else {}
    return {
        "accuracy": correct / asked,
        "correct": correct,
        "asked": asked,
        "store_hits": hits,
        "compact_s": stats.get("compact_s", 0.0),
        "compact_tokens": stats.get("compact_tokens", 0),
        "wall_s": time.perf_counter() - began,
        "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--policies", default="kvzip,expected_attention,snapkv,knorm,streaming_llm")
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from lmcompact.hf.prepare import prepare_model

    model = args.model or str(prepare_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    contexts = [build_shared_context(tokenizer, args.context, seed) for seed in range(args.samples)]
    rows: list[dict[str, Any]] = []
    cells: list[tuple[str, float, dict[str, Any] | None]] = [("full", 1.0, None)]
    for spec in args.policies.split(";" if ";" in args.policies else ","):
        policy, _, params = spec.partition(":")
        policy_params = {
            k: json.loads(v) for k, v in (p.split("=") for p in params.split("/") if p)
        }
        for budget in (float(b) for b in args.budgets.split(",")):
            extra = {"policy": policy, "budget": budget, "chunk_size": args.chunk_size}
            if "window" in policy_params:  # the connector's option, not the policy's
                extra["window"] = policy_params.pop("window")
            if policy_params:
                extra["policy_params"] = policy_params
            cells.append((spec, budget, extra))
    for policy, budget, extra in cells:
        row = {"policy": policy, "budget": budget, "context": args.context}
        row.update(run_cell(model, tokenizer, contexts, extra))
        rows.append(row)
        print(
            f"{policy:>20} {budget:5.2f}  acc {row['accuracy']:.2f} "
            f"({row['correct']}/{row['asked']})  hits {row['store_hits']}  "
            f"compact {row['compact_s']:.2f}s  wall {row['wall_s']:.0f}s",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
