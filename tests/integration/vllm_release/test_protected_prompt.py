"""``release.protect_prompt``: a long generation keeps the whole prompt and bounds the rest.

SmolLM2 (real weights) in vLLM's CPU engine, policy ``none`` (no prefill compaction), a
~300-token prompt (9 full blocks), a 128-token decode budget over generated tokens only. After
every engine step the test reads the request's block row in vLLM's pool: the prompt's 9
blocks stay the same physical blocks to the end, and the request never holds more than
9 + 4 + 1 blocks (the one being filled), which it reaches; the pool gets every block back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from connectors.vllm.patches.kv_cache_manager import audit_pool
from tests.integration.vllm_release.harness import (
    BLOCK_SIZE,
    engine_request_ids,
    kv_manager,
    release_engine,
    run,
)
from tests.integration.vllm_release.test_long_generation import text_prompt

pytestmark = pytest.mark.integration

NEW_TOKENS = 400
BUDGET_TOKENS = 128


@pytest.mark.parametrize("decode_policy", ["recent", "decoding_snapkv"])
def test_prompt_blocks_stay_and_generated_ones_keep_the_budget(
    smollm2_path: Path, decode_policy: str
) -> None:
    prompt = text_prompt(smollm2_path, 300)
    prompt_blocks = len(prompt) // BLOCK_SIZE
    extra = {
        "policy": "none",
        "store": False,
        "release": {
            "decode_budget_tokens": BUDGET_TOKENS,
            "decode_policy": decode_policy,
            "protect_prompt": True,
        },
    }
    rows: list[list[Any]] = []
    with release_engine(
        str(smollm2_path), extra, num_blocks=64, max_model_len=1024, max_num_batched_tokens=512
    ) as llm:
        start_free = kv_manager(llm).block_pool.get_num_free_blocks()
        table = kv_manager(llm).coordinator.single_type_managers[0].req_to_blocks

        def sample(step: int, outputs: list[Any]) -> None:
            rid = engine_request_ids(llm).get("long")
            if rid is not None and rid in table:
                rows.append([None if b.is_null else b.block_id for b in table[rid]])

        tokens = run(llm, {"long": prompt}, NEW_TOKENS, sample)["long"]
        assert kv_manager(llm).block_pool.get_num_free_blocks() == start_free
        assert audit_pool(kv_manager(llm)).ok

    assert len(tokens) == NEW_TOKENS and len(rows) >= NEW_TOKENS - 1
    first = rows[0][:prompt_blocks]
    assert None not in first
    assert all(row[:prompt_blocks] == first for row in rows)  # the prompt is never dropped
    held = [sum(b is not None for b in row) for row in rows]
    limit = prompt_blocks + BUDGET_TOKENS // BLOCK_SIZE + 1
    assert max(held) == limit, f"held at most {max(held)} blocks, expected {limit}"
    assert any(None in row for row in rows)  # generated blocks did go back to the pool
    assert -(-(len(prompt) + NEW_TOKENS) // BLOCK_SIZE) > limit + 4
