"""A capacity workload on a real in-process vLLM engine: many needle requests, one pool.

Every request is a chat turn holding a haystack of Python documentation text with one
"needle" sentence (a five-digit code) at a seeded depth, and a question about it at the
end. All requests arrive at once into an engine whose KV pool is fixed
(``num_gpu_blocks_override``); the loop steps the engine and records, per step, how many
requests are running, whether the step only decoded, its wall time and the free blocks.

Used by ``lmcompact bench capacity`` (one engine per subprocess).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

WORDS = ("red", "blue", "green", "amber", "violet", "silver", "orange", "black")


@dataclass(frozen=True)
class Workload:
    """Settings of one capacity run.

    Attributes:
        model: model folder.
        num_requests: requests sent at once.
        context_tokens: prompt length (approximate, within a few tokens).
        new_tokens: tokens generated per request (EOS ignored, so every run decodes alike).
        num_blocks: KV blocks in the pool, the null block included.
        block_size: tokens per block.
        max_num_seqs: vLLM's cap on running requests.
        max_num_batched_tokens: tokens per engine step.
        seed: needle placement and codes.
        dtype: model and KV dtype (float32 on CPU; bfloat16 on GPU).
        load_format: vLLM load format (``"dummy"``: random weights of the model's shape,
            for serving-shape runs; needle accuracy is then meaningless).
    """

    model: str
    num_requests: int
    context_tokens: int
    new_tokens: int
    num_blocks: int
    block_size: int = 32
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    seed: int = 0
    dtype: str = "float32"
    load_format: str = "auto"


@dataclass
class Trace:
    """What one run recorded, step by step."""

    running: list[int] = field(default_factory=list)
    free_blocks: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    decode_only: list[bool] = field(default_factory=list)
    scheduled: list[int] = field(default_factory=list)


def haystack_sentences() -> list[str]:
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    text = re.sub(r"\s+", " ", text)
    return [s.strip() + "." for s in text.split(". ") if 40 < len(s) < 400]


def needle_prompt(
    tokenizer: Any, sentences: list[str], context_tokens: int, rng: random.Random
) -> tuple[list[int], str]:
    """One chat prompt of about ``context_tokens`` tokens and its answer."""
    word = rng.choice(WORDS)
    code = str(rng.randrange(10000, 100000))
    needle = f"The secret code of the {word} door is {code}."
    question = f"What is the secret code of the {word} door? Answer with the five-digit code only."
    start = rng.randrange(len(sentences))
    body: list[str] = []
    overhead = len(tokenizer.encode(needle + " " + question)) + 40
    used = 0
    i = start
    while used < context_tokens - overhead:
        sentence = sentences[i % len(sentences)]
        body.append(sentence)
        used += len(tokenizer.encode(sentence))
        i += 1
    body.insert(
        rng.randrange(len(body) // 10, max(len(body) // 10 + 1, 9 * len(body) // 10)), needle
    )
    message = "Read the text.\n\n" + " ".join(body) + "\n\n" + question
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return list(ids), code


def run_workload(workload: Workload, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Run the workload once; ``extra`` None runs plain vLLM (no connector).

    Returns:
        Plain JSON data: settings, per-step trace, answers and derived figures.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import SamplingParams

    from connectors.vllm.offline import build_llm

    llm = build_llm(  # the one engine recipe; max_model_len is clipped to the pool
        workload.model,
        extra,
        dtype=workload.dtype,
        block_size=workload.block_size,
        max_model_len=workload.context_tokens + workload.new_tokens + 256,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        num_blocks=workload.num_blocks,
        load_format=workload.load_format,
        max_num_seqs=workload.max_num_seqs,
    )
    engine: Any = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    tokenizer = llm.get_tokenizer()
    rng = random.Random(workload.seed)
    sentences = haystack_sentences()
    answers: dict[str, str] = {}
    params = SamplingParams(temperature=0.0, max_tokens=workload.new_tokens, ignore_eos=True)
    prompt_lens = []
    for i in range(workload.num_requests):
        ids, code = needle_prompt(tokenizer, sentences, workload.context_tokens, rng)
        prompt_lens.append(len(ids))
        answers[f"n{i}"] = code
        engine.add_request(f"n{i}", {"prompt_token_ids": ids}, params)

    trace = Trace()
    original_schedule = scheduler.schedule

    def schedule(*args: Any, **kw: Any) -> Any:
        output = original_schedule(*args, **kw)
        counts = list(output.num_scheduled_tokens.values())
        trace.scheduled.append(len(counts))
        trace.decode_only.append(bool(counts) and all(c == 1 for c in counts))
        trace.running.append(len(scheduler.running))
        return output

    scheduler.schedule = schedule
    texts: dict[str, str] = {}
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        trace.step_s.append(time.perf_counter() - t0)
        trace.free_blocks.append(int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks()))
        for out in outputs:
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    wall = time.perf_counter() - began
    scheduler.schedule = original_schedule
    end_free = int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
    memory_stats: dict[str, Any] | None = None
    connector = getattr(scheduler, "connector", None)
    half = getattr(connector, "scheduler", None)
    if half is not None and half.planner is not None:
        stats = half.release_stats
        memory_stats = {"packs": stats.packs, "blocks_released": stats.blocks_released}
        from connectors.vllm.offline import worker_connector

        worker: Any = worker_connector().worker  # in-process: the worker side
        memory_stats["pack_seconds"] = float(worker.pack_stats["seconds"])
        memory_stats["packed_tokens"] = int(worker.pack_stats["tokens"])
        memory_stats["unscored_packs"] = int(worker.pack_stats["unscored"])
        memory_stats["capture_specs"] = int(worker.stats["capture_specs"])
        memory_stats["captures_found"] = int(worker.stats["captures_found"])
    engine.engine_core.shutdown()

    correct = sum(answers[r] in texts.get(r, "") for r in answers)
    n = min(len(trace.step_s), len(trace.decode_only))
    decode_steps = [i for i in range(n) if trace.decode_only[i]]
    decode_tokens = sum(trace.scheduled[i] for i in decode_steps)
    decode_time = sum(trace.step_s[i] for i in decode_steps)
    return {
        "workload": asdict(workload),
        "extra": dict(extra) if extra is not None else None,
        "prompt_tokens_mean": sum(prompt_lens) / len(prompt_lens),
        "peak_running": max(trace.running, default=0),
        "mean_running_decode_steps": (
            sum(trace.running[i] for i in decode_steps) / len(decode_steps)
        )
        if decode_steps
        else 0.0,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
        "output_tokens_per_s": workload.num_requests * workload.new_tokens / wall,
        "wall_s": wall,
        "steps": len(trace.step_s),
        "decode_only_steps": len(decode_steps),
        "needle_correct": correct,
        "needle_accuracy": correct / workload.num_requests,
        "free_blocks_start": workload.num_blocks - 1,
        "free_blocks_end": end_free,
        "memory": memory_stats,
        "trace": asdict(trace),
        "answers": {r: {"expected": answers[r], "text": texts.get(r, "")} for r in answers},
    }
