"""Admission with a decode budget in vLLM's CPU engine: the pool fills, nobody is preempted.

SmolLM2 (real weights), 12 requests of 256-token prompts and 320 generated tokens arrive
at once in a pool of 45 blocks (block 32). Prompts are packed to half at prefill end (8 ->
4 blocks) and generation is bounded to 6 full blocks. Without the decode budget each
request would reserve its growth to ``max_tokens`` (cdiv(576, 32) - 4 = 14 blocks: 3 at
once in 44); with it, a computed prompt reserves ``max(6, 4) + 1 = 7`` blocks.

After every engine step: the pool is consistent (no block both free and held, reference
counts equal to holders), no request holds more than the peak the admission rule gave it,
and nobody was preempted. Two requests are aborted on the way. At the end every block
is free again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from connectors.vllm.patches.kv_cache_manager import audit_pool
from lmcompact.compaction.admission import RequestShape
from tests.integration.vllm_release.harness import (
    BLOCK_SIZE,
    engine_request_ids,
    held_blocks,
    kv_manager,
    release_engine,
    run,
    scheduler,
)
from tests.integration.vllm_release.test_long_generation import text_prompt

pytestmark = pytest.mark.integration

NUM_BLOCKS = 45
PROMPT_TOKENS = 256
NEW_TOKENS = 320
BUDGET_TOKENS = 6 * BLOCK_SIZE
ABORTS = {150: ["r3"], 260: ["r8"]}  # engine step -> requests aborted after it


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("decode_policy", ["recent", "h2o", "recent-protect_prompt"])
def test_decode_budget_admission_fills_the_pool_without_preemption(
    smollm2_path: Path, decode_policy: str
) -> None:
    """``recent-protect_prompt``: the budget (3 blocks) counts generated blocks only, so a
    computed prompt reserves its 4 kept blocks + 3 + 1."""
    base = text_prompt(smollm2_path, PROMPT_TOKENS + 12)
    prompts = {f"r{i}": base[i : i + PROMPT_TOKENS] for i in range(12)}
    protect = decode_policy.endswith("protect_prompt")
    budget_tokens = 3 * BLOCK_SIZE if protect else BUDGET_TOKENS
    release: dict[str, Any] = {"prefill": "pack", "decode_budget_tokens": budget_tokens}
    if decode_policy == "h2o":
        release |= {"decode_policy": "h2o", "decode_recent_tokens": 2 * BLOCK_SIZE}
    if protect:
        release |= {"protect_prompt": True}
    extra = {"policy": "snapkv", "budget": 0.5, "window": 16, "store": False, "release": release}
    kept_blocks, hole_blocks = 4, 4
    bounded = RequestShape(
        PROMPT_TOKENS,
        NEW_TOKENS,
        BLOCK_SIZE,
        hole_blocks=hole_blocks,
        kept_blocks=kept_blocks,
        decode_budget_blocks=budget_tokens // BLOCK_SIZE,
        protected_blocks=kept_blocks if protect else 0,
    )
    growth = RequestShape(
        PROMPT_TOKENS, NEW_TOKENS, BLOCK_SIZE, hole_blocks=hole_blocks, kept_blocks=kept_blocks
    )
    assert (bounded.peak_blocks, growth.peak_blocks) == (8, 14)
    assert bounded.bounded_blocks == (4 + 3 + 1 if protect else 6 + 1)

    with release_engine(
        str(smollm2_path),
        extra,
        num_blocks=NUM_BLOCKS,
        max_model_len=1024,
        max_num_batched_tokens=512,
    ) as llm:
        sched = scheduler(llm)
        manager = kv_manager(llm)
        start_free = manager.block_pool.get_num_free_blocks()
        preempted: list[str] = []
        original = sched._preempt_request

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            preempted.append(request.request_id)
            return original(request, *args, **kwargs)

        sched._preempt_request = counting
        problems: list[str] = []
        peak_held: dict[str, int] = {}
        running: list[int] = []
        aborted: list[str] = []

        def check(step: int, outputs: list[Any]) -> None:
            audit = audit_pool(manager)
            if not audit.ok:
                problems.append(f"step {step}: {audit}")
            running.append(len(sched.running))
            for rid, engine_id in engine_request_ids(llm).items():
                held = held_blocks(llm, engine_id)
                peak_held[rid] = max(peak_held.get(rid, 0), held)
                if held > bounded.peak_blocks:
                    problems.append(f"step {step}: {rid} holds {held} > {bounded.peak_blocks}")
            for rid in ABORTS.get(step, []):
                llm.llm_engine.abort_request([engine_request_ids(llm)[rid]])
                aborted.append(rid)

        tokens = run(llm, prompts, NEW_TOKENS, check)
        stats = sched.connector.scheduler.release_stats

        print(
            f"{decode_policy}: peak running {max(running)}, deferred "
            f"{stats.admissions_deferred}, peak held {max(peak_held.values())}, "
            f"steps {len(running)}"
        )
        assert problems == []
        assert preempted == [] and stats.preemptions == 0
        assert sorted(aborted) == ["r3", "r8"]
        finished = set(prompts) - set(aborted)
        assert all(len(tokens[rid]) == NEW_TOKENS for rid in finished)
        assert stats.packs == len(prompts) and stats.repacks == 0
        assert stats.admissions_deferred > 0  # the pool was the limit
        # the rule's peak is reached: kept blocks + budget + the block being filled
        assert max(peak_held.values()) == bounded.peak_blocks
        usable = NUM_BLOCKS - 1
        # growth to max_tokens would carry at most usable // 14 = 3 requests at once
        assert max(running) > usable // growth.peak_blocks
        assert max(running) >= usable // bounded.bounded_blocks - 1
        assert manager.block_pool.get_num_free_blocks() == start_free == usable
        final = audit_pool(manager)
        assert final.ok and final.referenced == 0
