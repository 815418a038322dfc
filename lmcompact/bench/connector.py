"""``lmcompact bench connector``: TTFT with a compacted-prefix store hit vs recompute.

Real vLLM, in-process engine: on the CPU (float32, eager) with SmolLM2-135M and a natural
text prompt; with ``--shape llama3-8b`` a config-only folder of that shape with random
weights (``load_format="dummy"``, bf16 on CUDA, CUDA graphs on) and seeded random token
ids, for speed only. For each policy, one engine first serves a warm-up prompt of the same
length (so start-up costs, kernel compilation and first-shape captures are not in any timed
figure; its time is reported as ``ttft_cold_s``), then the measured prompt three times: the
first request computes it and stores its compacted chunks (recompute TTFT), the next two
load them (hit TTFT; the best of two is reported). TTFT is the wall time of a one-token
generation. ``cold_vs_warm`` is ``ttft_cold_s`` over ``ttft_recompute_s``: the first request
of a fresh engine against a later computed request of the same length (what start-up costs
the first request). A ``--configs`` label whose value is ``false`` is vLLM alone, no
connector (``"connector": false``, ``"budget": null``): the same cold request, then the
prompt once more, computed (its ``ttft_recompute_s``; with ``--decode-tokens``, its
``decode_ms_recompute``); it has no hits, store or compaction figures (null) and no
``--profile``. ``--profile`` adds a cProfile of one more hit (the host-side functions with the
most cumulative time; GPU work shows up as the synchronizations that wait for it),
``--profile-cold`` one of each engine's first request (vLLM alone included). Also
reported:
stored bytes vs the full KV of the same chunks, compaction time per 1k tokens (the
background thread's work: layout decode, window scores, policy, chunk build), and the
blocks a repeat of the prompt holds once its hole went back (loaded or packed in place), as
a fraction of the full prompt's (``blocks_held_fraction``: 1 minus the blocks that request
released over the prompt's blocks; holes are given back by the ``release`` group).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import platform
import pstats
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from lmcompact.bench.serve import SHAPES, shape_folder
from lmcompact.results import format_table, write_json

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
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="dummy-weight shape")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument(
        "--policy-params",
        type=json.loads,
        default={},
        help="JSON object, policy name -> its policy_params (e.g. "
        '\'{"kvzip": {"allocation": "ragged", "share": false}}\')',
    )
    parser.add_argument(
        "--per-head-slack",
        type=float,
        default=None,
        help="the connector's store.per_head slack for compacting policies (per-head "
        "stored counts; loads mask each head's padding)",
    )
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=0,
        help="also time N decode tokens after a hit and after a recompute (ms per token)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile one more hit (with --decode-tokens: and its decode); top functions "
        "in the JSON",
    )
    parser.add_argument(
        "--profile-cold",
        action="store_true",
        help="cProfile each engine's first request (rows of vLLM alone too): top functions "
        "in the JSON as profile_cold; its ttft_cold_s then includes the profiler's overhead",
    )
    parser.add_argument(
        "--configs",
        type=json.loads,
        default=None,
        help="JSON object, row label -> a whole kv_connector_extra_config, or false for vLLM "
        'alone without the connector (e.g. \'{"vllm": false, "default": {"budget": 0.25}, '
        '"none": {"policy": "none"}}\'); replaces '
        "--policies/--budget (store.chunk_size defaults to --chunk-size)",
    )
    parser.add_argument("--json", default=None, help="write results as JSON here ('-': stdout)")


def engine_options(shape: str | None) -> tuple[str, dict[str, Any]]:
    """dtype and ``LLM`` keywords: the CPU test setting, or a GPU serving one for shapes."""
    if shape is None:
        return "float32", {}
    return "bfloat16", {
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": False,
        "max_num_batched_tokens": None,  # vLLM's default token budget per step
    }


def measure(
    model: str,
    prompt: list[int],
    policy: str,
    budget: float,
    chunk_size: int,
    shape: str | None = None,
    block_size: int = 32,
    profile: bool = False,
    policy_params: dict[str, Any] | None = None,
    per_head_slack: float | None = None,
    decode_tokens: int = 0,
    config: dict[str, Any] | Literal[False] | None = None,
    profile_cold: bool = False,
) -> dict[str, Any]:
    """One row: ``policy`` at ``budget``, or with ``config`` that whole
    ``kv_connector_extra_config`` (``policy`` is then the row's label); ``config`` False:
    vLLM alone, no connector (see :func:`_measure_without_connector`)."""
    from connectors.vllm import offline

    if config is False:
        return _measure_without_connector(
            model, prompt, policy, shape, block_size, decode_tokens, profile_cold
        )
    if config is not None:
        extra = json.loads(json.dumps(config))  # a copy the bench may add store options to
        store = extra.setdefault("store", {})
        if isinstance(store, dict):  # "store": false runs the release group alone
            store.setdefault("chunk_size", chunk_size)
        budget = float(extra.get("budget", 0.5))
    else:
        store = {"chunk_size": chunk_size}
        extra = {"policy": policy, "budget": budget, "window": 64, "store": store}
        if policy_params:
            extra["policy_params"] = policy_params
        if per_head_slack is not None and policy != "none":
            store["per_head"] = {"slack": per_head_slack}
    if shape is not None and isinstance(store, dict):
        store.setdefault(
            "cpu_capacity_mb", 16384
        )  # a 16k prompt of the 8B shape is 2 GiB uncompacted
    llm = _engine_for(model, extra, shape, len(prompt), block_size)
    try:
        cold, cold_spots = _cold_request(llm, prompt, profile_cold)
        offline.connector_stats()  # the warm-up's saves end before anything is timed
        miss = offline.generate(llm, prompt, max_tokens=1)
        before = offline.connector_stats()
        hits = [offline.generate(llm, prompt, max_tokens=1) for _ in range(2)]
        hit_s = min(h.seconds for h in hits)
        stats = offline.connector_stats()
        hot_spots = _profiled(llm, prompt, "hit")[1] if profile and not decode_tokens else None
        decode: dict[str, float] = {}
        released = offline.request_counters(llm).get("blocks_released", 0)
        if decode_tokens:
            # a hit, then a prompt never seen (computed), each decoding N more tokens
            long_hit = offline.generate(llm, prompt, max_tokens=1 + decode_tokens)
            released = offline.request_counters(llm).get("blocks_released", 0) - released
            if profile:  # with --decode-tokens, --profile covers a hit and its decode
                hot_spots = _profiled(llm, prompt, "hit", 1 + decode_tokens)[1]
            fresh = _other_prompt(_other_prompt(prompt))
            long_miss = offline.generate(llm, fresh, max_tokens=1 + decode_tokens)
            decode = {
                "decode_ms_hit": 1000 * (long_hit.seconds - hit_s) / decode_tokens,
                "decode_ms_recompute": 1000 * (long_miss.seconds - miss.seconds) / decode_tokens,
            }
        else:  # a hit's hole goes back from the step after its load: give it a second step
            offline.generate(llm, prompt, max_tokens=2)
            released = offline.request_counters(llm).get("blocks_released", 0) - released
    finally:
        offline.shutdown(llm)
    exact = config.get("policy") == "none" if config is not None else policy == "none"
    if stats.get("loaded_chunks", 0) <= before.get("loaded_chunks", 0) and not exact:
        logger.warning("%s: the repeated prompt loaded nothing from the store", policy)
    row: dict[str, Any] = {
        "policy": policy,
        "connector": True,
        "budget": budget if not exact else 1.0,
        "prompt_tokens": len(prompt),
        "ttft_cold_s": cold.seconds,
        "ttft_recompute_s": miss.seconds,
        "cold_vs_warm": _ratio(cold.seconds, miss.seconds),
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
        "stored_vs_bf16": (
            stats["bytes_stored"] / stats["bytes_full_bf16"]
            if stats.get("bytes_full_bf16")
            else None
        ),
        "blocks_held_fraction": 1.0 - released / -(-len(prompt) // block_size),
        "surprisal_tokens": int(stats.get("surprisal_tokens", 0)),
        "surprisal_s": float(stats.get("surprisal_s", 0.0)),
    }
    if config is not None:
        row["config"] = config
    row.update(decode)
    if decode:
        row["decode_ratio"] = decode["decode_ms_hit"] / decode["decode_ms_recompute"]
    if per_head_slack is not None and policy != "none":
        row["per_head_slack"] = per_head_slack
    if policy_params:
        row["policy_params"] = policy_params
    if hot_spots is not None:
        row["profile_hit"] = hot_spots
    if cold_spots is not None:
        row["profile_cold"] = cold_spots
    return row


def _measure_without_connector(
    model: str,
    prompt: list[int],
    label: str,
    shape: str | None,
    block_size: int,
    decode_tokens: int,
    profile_cold: bool = False,
) -> dict[str, Any]:
    """A row of vLLM alone (no connector, so no store, hits or counters): the cold first
    request of a fresh engine, then ``prompt`` computed (its recompute TTFT); with
    ``decode_tokens``, a prompt never seen decoding that many more tokens."""
    from connectors.vllm import offline

    llm = _engine_for(model, None, shape, len(prompt), block_size)
    try:
        cold, cold_spots = _cold_request(llm, prompt, profile_cold)
        miss = offline.generate(llm, prompt, max_tokens=1)
        decode_ms = None
        if decode_tokens:
            fresh = _other_prompt(_other_prompt(prompt))
            long_miss = offline.generate(llm, fresh, max_tokens=1 + decode_tokens)
            decode_ms = 1000 * (long_miss.seconds - miss.seconds) / decode_tokens
    finally:
        offline.shutdown(llm)
    row: dict[str, Any] = {
        "policy": label,
        "connector": False,
        "budget": None,
        "prompt_tokens": len(prompt),
        "ttft_cold_s": cold.seconds,
        "ttft_recompute_s": miss.seconds,
        "cold_vs_warm": _ratio(cold.seconds, miss.seconds),
        **dict.fromkeys(_CONNECTOR_FIGURES),
        "config": False,
    }
    if decode_tokens:
        row.update(decode_ms_hit=None, decode_ms_recompute=decode_ms, decode_ratio=None)
    if cold_spots is not None:
        row["profile_cold"] = cold_spots
    return row


_CONNECTOR_FIGURES = (
    "ttft_hit_s",
    "speedup",
    "loaded_chunks",
    "bytes_stored",
    "bytes_full",
    "stored_fraction",
    "compaction_s_per_1k_tokens",
    "stored_vs_bf16",
    "blocks_held_fraction",
    "surprisal_tokens",
    "surprisal_s",
)
"""Row figures of the connector (hits, store, compaction): None in a row of vLLM alone."""


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _add_prefill_ratios(rows: list[dict[str, Any]]) -> None:
    """``recompute_vs_exact``: each row's recompute (a prefill that also saves, scoring
    its tokens where the store policy needs it; vLLM alone for a row without the
    connector) over the exact row's (the connector at budget 1), measured in the same
    invocation; absent without an exact row."""
    exact = next((r for r in rows if r.get("connector", True) and r.get("budget") == 1.0), None)
    if exact is None or not exact["ttft_recompute_s"]:
        return
    for r in rows:
        r["recompute_vs_exact"] = r["ttft_recompute_s"] / exact["ttft_recompute_s"]


def _other_prompt(prompt: list[int]) -> list[int]:
    """A prompt of the same length that shares no chunk with ``prompt`` (its first token
    differs, and chunk keys hash the whole prefix)."""
    return [prompt[-1], *prompt[:-1]] if prompt[0] != prompt[-1] else [prompt[0] + 1, *prompt[1:]]


def _engine_for(
    model: str, extra: dict[str, Any] | None, shape: str | None, prompt_len: int, block_size: int
) -> Any:
    """A fresh in-process engine for one row (``extra`` None: without the connector)."""
    from connectors.vllm import offline

    dtype, engine = engine_options(shape)
    return offline.build_llm(
        model,
        extra,
        dtype=dtype,
        max_model_len=prompt_len + 64,
        block_size=block_size,
        engine=engine,
    )


def _cold_request(
    llm: Any, prompt: list[int], profile: bool
) -> tuple[Any, list[dict[str, Any]] | None]:
    """The fresh engine's first request (a prompt of the same length sharing no chunk with
    ``prompt``), under cProfile when ``profile`` (its time then includes the profiler's)."""
    from connectors.vllm import offline

    if profile:
        return _profiled(llm, _other_prompt(prompt), "cold")
    return offline.generate(llm, _other_prompt(prompt), max_tokens=1), None


def _profiled(
    llm: Any, prompt: list[int], label: str, max_tokens: int = 1, top: int = 30
) -> tuple[Any, list[dict[str, Any]]]:
    """One request (generating ``max_tokens``) under cProfile: its output and the ``top``
    functions by cumulative time (seconds), logged under ``label``."""
    from connectors.vllm import offline

    profiler = cProfile.Profile()
    profiler.enable()
    out = offline.generate(llm, prompt, max_tokens=max_tokens)
    profiler.disable()
    return out, _top_functions(profiler, label, top)


def _top_functions(profiler: cProfile.Profile, label: str, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions by cumulative time, then the ``top`` by own time not among
    them (where a stall is spent: an allocation, a compile, a synchronization)."""
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (_, calls, tot, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{'/'.join(Path(file).parts[-2:])}:{line}({name})",
                "calls": calls,
                "cum_s": round(cum, 5),
                "tot_s": round(tot, 5),
            }
        )
    by_cum = sorted(rows, key=lambda r: r["cum_s"], reverse=True)[:top]
    shown = {r["function"] for r in by_cum}
    by_own = sorted(rows, key=lambda r: r["tot_s"], reverse=True)[:top]
    chosen = by_cum + [r for r in by_own if r["function"] not in shown]
    for r in chosen:
        logger.info(
            "%s profile %8.4f s cum %8.4f s own %7d calls %s",
            label,
            r["cum_s"],
            r["tot_s"],
            r["calls"],
            r["function"],
        )
    return chosen


def run(args: argparse.Namespace) -> int:
    from connectors.vllm import offline

    configs: dict[str, Any] = {} if args.configs is None else args.configs
    if not isinstance(configs, dict) or not all(
        isinstance(c, dict) or c is False for c in configs.values()
    ):
        raise SystemExit("--configs must be a JSON object of label -> object or false")
    offline.in_process_env(kv_cache_gib=2)
    with tempfile.TemporaryDirectory() as scratch:
        if args.shape is not None:
            args.model = str(shape_folder(args.shape, Path(scratch)))
            vocab = int(str(SHAPES[args.shape]["vocab_size"]))
            gen = torch.Generator().manual_seed(0)
            prompt = torch.randint(100, vocab - 100, (args.prompt_tokens,), generator=gen).tolist()
        else:
            prompt = _text_prompt(args)
        policies = list(configs) or [p.strip() for p in args.policies.split(",") if p.strip()]
        rows = [
            measure(
                args.model,
                prompt,
                policy,
                args.budget,
                args.chunk_size,
                args.shape,
                args.block_size,
                args.profile,
                args.policy_params.get(policy),
                args.per_head_slack,
                args.decode_tokens,
                configs.get(policy),
                profile_cold=args.profile_cold,
            )
            for policy in tqdm(policies, desc="policies")
        ]
        _add_prefill_ratios(rows)
    print(
        format_table(
            rows,
            [
                "policy",
                "budget",
                "prompt_tokens",
                "ttft_cold_s",
                "ttft_recompute_s",
                "cold_vs_warm",
                "ttft_hit_s",
                "speedup",
                "stored_fraction",
                "blocks_held_fraction",
                "compaction_s_per_1k_tokens",
                "stored_vs_bf16",
                "recompute_vs_exact",
                *(
                    ["decode_ms_recompute", "decode_ms_hit", "decode_ratio"]
                    if args.decode_tokens
                    else []
                ),
            ],
        )
    )
    names = (
        "shape",
        "prompt_tokens",
        "chunk_size",
        "block_size",
        "per_head_slack",
        "decode_tokens",
    )
    settings = {k: getattr(args, k) for k in names}
    write_json(
        args.json,
        {
            "machine": platform.machine(),
            "device": _device_name(),
            "settings": settings,
            "rows": rows,
        },
    )
    return 0


def _text_prompt(args: argparse.Namespace) -> list[int]:
    from transformers import AutoTokenizer

    from lmcompact.eval.chat_needle import build_prompt, haystack

    if args.model is None:
        from lmcompact.hf.prepare import prepare_model

        args.model = str(prepare_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    return build_prompt(tokenizer, haystack(tokenizer, args.prompt_tokens - 40, 0.5))


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
