"""``lmcompact demo``: compacted KV stored by one vLLM request, served to the next.

Real vLLM on the CPU with SmolLM2-135M-Instruct and the embedded CPU store. A long
haystack hides one needle; the first request computes the prompt and stores its
compacted prefix; the second request with the same context and question loads it
(store hit) and must still find the needle.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from typing import Any

from lmcompact.cli._output import format_table, write_json

NAME = "demo"
HELP = "vLLM + SmolLM2 on the CPU: store a compacted prefix, reload it, answer a needle question"

logger = logging.getLogger(__name__)

NEEDLE_VALUE = "7481"
NEEDLE = f"Remember this: the secret code of the blue door is {NEEDLE_VALUE}. "
QUESTION = "What is the secret code of the blue door? Reply with the number only."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="snapkv", help="compaction policy (default snapkv)")
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


def haystack(tokenizer: Any, context_tokens: int, depth: float, seed: int = 0) -> str:
    """Public-domain filler (Python's own docs) of about ``context_tokens`` with the needle."""
    from pydoc_data.topics import topics

    paragraphs = [" ".join(text.split()) for text in topics.values() if len(text) > 200]
    random.Random(seed).shuffle(paragraphs)
    parts: list[str] = []
    used = 0
    for paragraph in paragraphs:
        sentences = paragraph.split(". ")[:6]
        text = ". ".join(sentences).strip() + ". "
        used += len(tokenizer.encode(text, add_special_tokens=False))
        parts.append(text)
        if used >= context_tokens:
            break
    parts.insert(max(1, int(depth * len(parts))), NEEDLE)
    return "".join(parts)


def build_prompt(tokenizer: Any, context: str) -> list[int]:
    messages = [{"role": "user", "content": f"{context}\n\n{QUESTION}"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def run(args: argparse.Namespace) -> int:
    from lmcompact.vllm import offline
    from lmcompact.vllm.preflight import check_extra_config

    extra = {
        "policy": args.policy,
        "budget": args.budget,
        "window": args.window,
        "store": {"chunk_size": args.chunk_size, "tiers": ["cpu"]},
    }
    try:  # bad options fail here, before the model and vLLM load
        check_extra_config("LMCompactConnector", extra)
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
