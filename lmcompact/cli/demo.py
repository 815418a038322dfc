"""``lmcompact demo``: compacted KV stored by one vLLM request, served to the next.

Real vLLM on the CPU with SmolLM2-135M-Instruct and the embedded CPU store. A long
haystack hides one needle; the first request computes the prompt and stores its
compacted prefix; the second request with the same context and question loads it
(store hit) and must still find the needle (the prompt: :mod:`lmcompact.eval.chat_needle`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from lmcompact.eval.chat_needle import NEEDLE_VALUE, build_prompt, haystack
from lmcompact.results import format_table, write_json

NAME = "demo"
HELP = "vLLM + SmolLM2 on the CPU: store a compacted prefix, reload it, answer a needle question"

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        default="self_info",
        help="compaction policy of the stored prefix (default self_info, scored in the engine)",
    )
    parser.add_argument("--budget", type=float, default=0.5, help="kept fraction (default 0.5)")
    parser.add_argument(
        "--context-tokens", type=int, default=1500, help="haystack length in tokens (default 1500)"
    )
    parser.add_argument(
        "--needle-depth",
        type=float,
        default=0.4,
        help="needle position as a fraction of the haystack (default 0.4)",
    )
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per stored chunk")
    parser.add_argument("--window", type=int, default=48, help="observation window (queries)")
    parser.add_argument(
        "--model", default=None, help="model folder (default: prepared SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length")
    parser.add_argument("--json", default=None, help="write the result as JSON here ('-': stdout)")


def run(args: argparse.Namespace) -> int:
    from connectors.vllm import offline
    from connectors.vllm.config import ConnectorConfig

    extra = {
        "policy": args.policy,
        "budget": args.budget,
        "window": args.window,
        "store": {"chunk_size": args.chunk_size, "tiers": ["cpu"]},
    }
    try:  # bad options fail here, before the model and vLLM load
        ConnectorConfig.from_extra(extra)
    except ValueError as exc:
        print(f"lmcompact demo: {exc}", file=sys.stderr)
        return 2
    offline.in_process_env()
    from transformers import AutoTokenizer

    if args.model is None:
        from lmcompact.hf.prepare import prepare_model

        args.model = str(prepare_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt = build_prompt(tokenizer, haystack(tokenizer, args.context_tokens, args.needle_depth))
    llm = offline.build_llm(args.model, extra, max_model_len=max(4096, len(prompt) + 64))
    try:
        first = offline.generate(llm, prompt, max_tokens=1)  # miss: computes, then stores
        stats = offline.connector_stats()
        loaded_before = stats.get("loaded_chunks", 0)
        second = offline.generate(llm, prompt, max_tokens=1)  # hit: loads the compacted prefix
        answer = offline.generate(llm, prompt, max_tokens=args.max_tokens)
        stats = offline.connector_stats()
    finally:
        offline.shutdown(llm)
    hit = stats.get("loaded_chunks", 0) > loaded_before
    result = {
        "policy": args.policy,
        "budget": args.budget,
        "prompt_tokens": len(prompt),
        "chunk_size": args.chunk_size,
        "bytes_stored": int(stats.get("bytes_stored", 0)),
        "bytes_full": int(stats.get("bytes_full", 0)),
        "store_hit": hit,
        "answer": answer.text.strip(),
        "answer_correct": NEEDLE_VALUE in answer.text,
        "ttft_first_s": first.seconds,
        "ttft_second_s": second.seconds,
        "compaction_s_per_1k_tokens": (
            1000 * stats["compact_s"] / stats["compact_tokens"]
            if stats.get("compact_tokens")
            else None
        ),
    }
    ratio = result["bytes_stored"] / result["bytes_full"] if result["bytes_full"] else None
    print(
        format_table(
            [
                {"request": "first (miss, stores)", "ttft_s": first.seconds, "store_hit": False},
                {"request": "second (same context)", "ttft_s": second.seconds, "store_hit": hit},
            ]
        )
    )
    print(
        f"policy {args.policy} budget {args.budget}: stored {result['bytes_stored']} of "
        f"{result['bytes_full']} bytes ({ratio if ratio is None else round(ratio, 3)}); "
        f"answer {result['answer']!r} correct={result['answer_correct']}"
    )
    write_json(args.json, result)
    return 0 if hit and result["answer_correct"] else 1
