"""One connector scenario at a given tensor-parallel size, printed as one JSON line.

Run by ``test_tensor_parallel.py`` as a script (one process per engine: TP > 1 starts one
vLLM worker process per rank with ``distributed_executor_backend="mp"``; the engine core,
and so the scheduler half of the connector, stays in this process, where its state is read).

Modes:
  * ``store``: ``LMCompactConnector`` with a CPU tier. Pass 1 computes the prompt and each
    rank stores its compacted slices; pass 2 repeats the prompt, which loads the stored prefix
    compacted. Prints each pass's greedy tokens and ``num_cached_tokens`` and the scheduler
    half's counters (with ``--engine-process`` the engine core runs in its own process, as
    under ``vllm serve``, and only the passes are printed).
  * ``redis``: the same with a Redis tier, and pass 2 on a second engine (the stored slices
    are found through the store's index, not through the workers' reports).
  * ``release``: ``LMCompactConnector`` with the ``"release"`` group (the options name it)
    packs prompts in place; the engine is stepped by hand and the block pool audited after
    every step. Prints tokens per request, the release counters, the step in which each
    request's hole blocks came back and the audit's findings.

Environment: ``VLLM_CPU_OMP_THREADS_BIND`` must name one CPU list per rank (``"0|1"``); vLLM's
automatic binding wants one NUMA node per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

BLOCK_SIZE = 32


def _llm(model: str, tp: int, extra: dict[str, Any], num_blocks: int | None) -> Any:
    from connectors.vllm.offline import build_llm

    return build_llm(
        model,
        extra,
        connector="LMCompactConnector",
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        num_blocks=num_blocks,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
    )


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def _pass(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0)}


def run_store(model: str, tp: int, extra: dict[str, Any], prompt: list[int], fresh: bool) -> Any:
    """Pass 1 stores, pass 2 loads (on a fresh engine when ``fresh``)."""
    llm = _llm(model, tp, extra, None)
    passes = [_pass(llm, prompt, 12)]
    index_wait_s = None
    if fresh:
        # the ranks save on background threads (and Redis writes are queued): wait until
        # the store's index holds every rank's slice of every chunk, then start over
        half = _scheduler(llm).connector.scheduler
        keys = half.keyer.keys(
            prompt[: (len(prompt) - 1) // half.keyer.chunk_size * half.keyer.chunk_size]
        )
        began = time.monotonic()
        while half._lookup(keys) < len(keys) and time.monotonic() - began < 60:
            time.sleep(0.2)
        index_wait_s = time.monotonic() - began
        _shutdown(llm)
        llm = _llm(model, tp, extra, None)
    passes.append(_pass(llm, prompt, 12))
    result: dict[str, Any] = {"passes": passes, "index_wait_s": index_wait_s}
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":  # the scheduler half is here
        half = _scheduler(llm).connector.scheduler
        result.update(stats=dict(half.stats), tp_size=half.tp_size)
    _shutdown(llm)
    return result


def run_release(
    model: str, tp: int, extra: dict[str, Any], prompts: dict[str, list[int]], num_blocks: int
) -> Any:
    """Every prompt at once, stepped by hand; the pool audited after every step."""
    from vllm import SamplingParams

    from connectors.vllm.patches.kv_cache_manager import audit_pool

    if "release" not in extra:
        raise ValueError('release mode runs the "release" group: name it in --extra')
    llm = _llm(model, tp, extra, num_blocks)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for req_id, ids in prompts.items():
        engine.add_request(req_id, {"prompt_token_ids": ids}, params)
    sched = _scheduler(llm)
    connector = sched.connector
    half = connector.scheduler
    release = half.release_stats
    manager = sched.kv_cache_manager
    problems: list[str] = []
    released_at: dict[str, int] = {}
    freed_before = 0
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        audit = audit_pool(manager)
        if not audit.ok:
            problems.append(f"step {step}: {audit}")
        if release.blocks_released > freed_before:
            for rid, state in half.states.items():
                if state.freed:
                    released_at.setdefault(rid.rsplit("-", 1)[0], step)
            freed_before = release.blocks_released
        step += 1
    final = audit_pool(manager)
    planner = half.planner
    expected = {
        rid: planner.fresh_hole(len(ids))[1]  # what the planner promises per prompt
        for rid, ids in prompts.items()
    }
    result = {
        "tokens": tokens,
        "tp_size": connector.spec.facts.tp_size,
        "blocks_released": release.blocks_released,
        "packs": release.packs,
        "preemptions": release.preemptions,
        "expected_hole_blocks": expected,
        "kept_blocks": {
            rid: planner.kept_blocks(len(ids) // BLOCK_SIZE) for rid, ids in prompts.items()
        },
        "released_at_step": released_at,
        "problems": problems,
        "final_free": final.num_free,
        "pool_blocks": final.num_blocks,
        "steps": step,
    }
    _shutdown(llm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--mode", choices=["store", "redis", "release"], required=True)
    parser.add_argument("--extra", required=True, help="kv_connector_extra_config JSON")
    parser.add_argument("--prompts", required=True, help='JSON {"id": [token ids]}')
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--engine-process", action="store_true", help="store mode only")
    args = parser.parse_args()
    # the engine core in this process, unless --engine-process (as `vllm serve` runs it)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.engine_process else "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    extra = json.loads(args.extra)
    prompts = {k: [int(t) for t in v] for k, v in json.loads(args.prompts).items()}
    if args.mode == "release":
        result = run_release(args.model, args.tp, extra, prompts, args.num_blocks)
    else:
        prompt = next(iter(prompts.values()))
        result = run_store(args.model, args.tp, extra, prompt, fresh=args.mode == "redis")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
