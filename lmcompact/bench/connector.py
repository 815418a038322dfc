"""``lmcompact bench connector``: TTFT with a compacted-prefix store hit vs recompute.

Real vLLM on the CPU (in-process engine, float32) with SmolLM2-135M. For each policy, a
~4k-token prompt is sent three times to one engine: the first request computes the prompt
and stores its compacted chunks (recompute TTFT), the next two load them (hit TTFT; the
best of two is reported). TTFT is the wall time of a one-token generation. Also reported:
stored bytes vs the full KV of the same chunks, and compaction time per 1k tokens (the
background thread's work: layout decode, window scores, policy, chunk build).
"""

from __future__ import annotations

import argparse
import logging
import platform
from typing import Any

from lmcompact.cli._output import format_table, write_json

NAME = "connector"
HELP = "vLLM connector: TTFT of a ~4k-token prompt, store hit vs recompute; bytes; compaction"

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policies", default="none,snapkv", help="comma-separated policies (default none,snapkv)"
    )
    parser.add_argument("--budget", type=float, default=0.5, help="kept fraction (default 0.5)")
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="prompt length")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--model", default=None, help="model folder (default SmolLM2-135M)")
    parser.add_argument("--json", default=None, help="write results as JSON here ('-': stdout)")


def measure(
    model: str, prompt: list[int], policy: str, budget: float, chunk_size: int
) -> dict[str, Any]:
    from connectors import offline

    extra = {"policy": policy, "budget": budget, "chunk_size": chunk_size, "window": 64}
    llm = offline.build_llm(model, extra, max_model_len=len(prompt) + 64)
    try:
        miss = offline.generate(llm, prompt, max_tokens=1)
        offline.connector_stats()
        hits = [offline.generate(llm, prompt, max_tokens=1) for _ in range(2)]
        stats = offline.connector_stats()
    finally:
        offline.shutdown(llm)
    hit_s = min(h.seconds for h in hits)
    return {
        "policy": policy,
        "budget": budget if policy != "none" else 1.0,
        "prompt_tokens": len(prompt),
        "ttft_recompute_s": miss.seconds,
        "ttft_hit_s": hit_s,
        "speedup": miss.seconds / hit_s if hit_s else None,
        "loaded_chunks": int(stats.get("loaded_chunks", 0)),
        "bytes_stored": int(stats.get("bytes_stored", 0)),
        "bytes_full": int(stats.get("bytes_full", 0)),
        "stored_fraction": (
            stats["bytes_stored"] / stats["bytes_full"] if stats.get("bytes_full") else None
        ),
        "compaction_s_per_1k_tokens": (
            1000 * stats["compact_s"] / stats["compact_tokens"]
            if stats.get("compact_tokens")
            else None
        ),
    }


def run(args: argparse.Namespace) -> int:
    from connectors import offline

    offline.in_process_env(kv_cache_gib=2)
    from transformers import AutoTokenizer

    from lmcompact.cli.demo import build_prompt, haystack

    if args.model is None:
        from lmcompact.hf.prepare import prepare_model

        args.model = str(prepare_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt = build_prompt(tokenizer, haystack(tokenizer, args.prompt_tokens - 40, 0.5))
    rows = [
        measure(args.model, prompt, p.strip(), args.budget, args.chunk_size)
        for p in args.policies.split(",")
        if p.strip()
    ]
    print(
        format_table(
            rows,
            [
                "policy",
                "budget",
                "prompt_tokens",
                "ttft_recompute_s",
                "ttft_hit_s",
                "speedup",
                "stored_fraction",
                "compaction_s_per_1k_tokens",
            ],
        )
    )
    write_json(args.json, {"machine": platform.machine(), "rows": rows})
    return 0
