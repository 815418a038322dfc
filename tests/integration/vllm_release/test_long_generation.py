"""A 2k-token generation with StreamingLLM stays within its KV budget plus one block.

SmolLM2 (real weights) in vLLM's CPU engine generates 2048 tokens after a ~300-token
prompt with a 512-token decode budget. After every engine step the test counts the blocks
the request really holds in vLLM's block pool: never more than 16 + 1, while the sequence
ends up needing 73 blocks without compaction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from connectors.vllm.patches.kv_cache_manager import audit_pool
from tests.integration.vllm_release.harness import (
    BLOCK_SIZE,
    engine_request_ids,
    held_blocks,
    kv_manager,
    release_engine,
    run,
)

pytestmark = pytest.mark.integration

NEW_TOKENS = 2048
BUDGET_TOKENS = 512


def text_prompt(model_dir: Path, tokens: int) -> list[int]:
    """About ``tokens`` tokens of Python's own documentation text."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer(topics["assignment"])["input_ids"]
    return list(ids[:tokens])


def test_streaming_generation_keeps_budget_plus_one_block(smollm2_path: Path) -> None:
    prompt = text_prompt(smollm2_path, 300)
    extra = {
        "policy": "streaming_llm",
        "budget": 0.5,
        "store": False,
        "release": {"prefill": "blocks", "decode_budget_tokens": BUDGET_TOKENS},
    }
    samples: list[int] = []
    with release_engine(
        str(smollm2_path), extra, num_blocks=96, max_model_len=2560, max_num_batched_tokens=512
    ) as llm:
        start_free = kv_manager(llm).block_pool.get_num_free_blocks()

        def sample(step: int, outputs: list[Any]) -> None:
            ids = engine_request_ids(llm)
            if "long" in ids:
                samples.append(held_blocks(llm, ids["long"]))

        tokens = run(llm, {"long": prompt}, NEW_TOKENS, sample)["long"]
        assert kv_manager(llm).block_pool.get_num_free_blocks() == start_free
        assert audit_pool(kv_manager(llm)).ok

    limit = BUDGET_TOKENS // BLOCK_SIZE + 1
    full_length_blocks = -(-(len(prompt) + NEW_TOKENS) // BLOCK_SIZE)
    assert len(tokens) == NEW_TOKENS
    assert len(samples) >= NEW_TOKENS - 1  # one sample per decode step
    assert max(samples) <= limit, f"held {max(samples)} blocks, budget + 1 is {limit}"
    assert max(samples[-100:]) == limit  # the budget is used, not undershot
    assert full_length_blocks > 4 * limit
