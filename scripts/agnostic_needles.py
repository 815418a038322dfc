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

from connectors.vllm import offline
from lmcompact.eval.tasks import StoredContext, build_stored_context, make_needles, score_needle
from lmcompact.eval.text import text_stream

MAX_TOKENS = 8
DEPTHS = (0.2, 0.5, 0.8)


def shared_context(tokenizer: Any, context_tokens: int, seed: int) -> StoredContext:
    """A context of exactly ``context_tokens`` ids of pydoc text hiding one colored-door
    needle per depth of :data:`DEPTHS`, and one question per needle."""
    needles = make_needles(seed, DEPTHS, "pydoc")
    return build_stored_context(
        tokenizer, context_tokens, seed, DEPTHS, text_stream(seed), needles=needles
    )


def greedy(llm: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy token ids (``max_tokens`` of them, end of sequence ignored)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def run_cell(
    model: str,
    tokenizer: Any,
    contexts: list[StoredContext],
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    """Accuracy of every question of every context; the context is stored first."""
    correct = hits = asked = 0
    answers: list[str] = []
    began = time.perf_counter()
    with offline.engine(model, extra, max_model_len=4608) as llm:  # float32, block 32
        connector = offline.worker_connector()
        for ctx in contexts:
            if connector is not None:
                greedy(llm, ctx.context_ids, 1)  # the request that stores the context
                connector.worker.drain()
            for index, needle in enumerate(ctx.needles):
                before = connector.worker.stats["loaded_chunks"] if connector else 0
                out = tokenizer.decode(greedy(llm, ctx.prompt(index), MAX_TOKENS))
                if connector is not None:
                    connector.worker.drain()
                    hits += connector.worker.stats["loaded_chunks"] > before
                asked += 1
                correct += score_needle(out, needle.passkey) == 1.0
                answers.append(out)
        stats = dict(connector.worker.stats) if connector else {}
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
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--policies", default="kvzip,expected_attention,snapkv,knorm,streaming_llm")
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from lmcompact.hf.prepare import prepare_model

    offline.in_process_env(kv_cache_gib=1)
    model = args.model or str(prepare_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    contexts = [
        shared_context(tokenizer, args.context, seed)
        for seed in range(args.first_seed, args.first_seed + args.samples)
    ]
    rows: list[dict[str, Any]] = []
    cells: list[tuple[str, float, dict[str, Any] | None]] = [("full", 1.0, None)]
    for spec in args.policies.split(";" if ";" in args.policies else ","):
        policy, _, params = spec.partition(":")
        policy_params = {
            k: json.loads(v) for k, v in (p.split("=") for p in params.split("/") if p)
        }
        window = policy_params.pop("window", None)  # the connector's option, not the policy's
        for budget in (float(b) for b in args.budgets.split(",")):
            cell: dict[str, Any] = {
                "policy": policy,
                "budget": budget,
                "store": {"chunk_size": args.chunk_size},
            }
            if window is not None:
                cell["window"] = window
            if policy_params:
                cell["policy_params"] = dict(policy_params)
            cells.append((spec, budget, cell))
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
