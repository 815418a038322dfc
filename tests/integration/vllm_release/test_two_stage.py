"""``"compact_on": "both"`` (two-stage loads) in a real vLLM CPU engine with SmolLM2 (float32).

Request 1 (the context and a first question) stores the context compacted by the store's
query-agnostic policy at ``store.budget``; request 2 asks another question about the same
context: it loads the stored selection (a hole after it), and at its prefill end the loaded
rows and its own tail are packed again to ``budget`` with SnapKV, the question in its window.
The hole then spans ``[kept, prompt)``: the GPU holds the final budget, the store the looser one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmcompact.eval.tasks import build_stored_context, score_needle
from lmcompact.eval.text import text_stream
from tests.integration.vllm_release.harness import (
    BLOCK_SIZE,
    kv_manager,
    release_engine,
    run,
    scheduler,
)

pytestmark = pytest.mark.integration

CONTEXT = 1024  # 4 chunks of 256
STORE_BUDGET = 0.75
BUDGET = 0.5
EXTRA: dict[str, Any] = {
    "policy": "snapkv",
    "budget": BUDGET,
    "store": {
        "compact_on": "both",
        "budget": STORE_BUDGET,
        "policy": "expected_attention",
        "async_save": False,
    },
    "release": {"prefill": "pack"},
}


def test_stored_compacted_then_packed_again_at_load(smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    from connectors.vllm.offline import worker_connector

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    stored = build_stored_context(tokenizer, CONTEXT, 1, [0.25, 0.75], text_stream(1))
    with release_engine(str(smollm2_path), EXTRA, max_model_len=1536) as llm:
        connector = scheduler(llm).connector
        plans = connector.scheduler
        release = plans.release_stats
        worker = worker_connector().worker
        namespace = connector.spec.namespaces[0]
        assert namespace.policy_name == "expected_attention"
        assert namespace.policy_params["budget"] == STORE_BUDGET

        first = run(llm, {"first": stored.prompt(0)}, 8)["first"]
        assert worker.stats["saved_chunks"] == CONTEXT // 256
        chunks = connector.store.get_many(plans.keyer.keys(stored.context_ids))
        kept = int(STORE_BUDGET * 256)
        assert all(c is not None and c.uniform_count() == kept for c in chunks)
        assert release.packs == 1 and release.repacked_loads == 0  # request 1: a plain pack
        assert score_needle(str(tokenizer.decode(first)), stored.needles[0].passkey) == 1.0

        free_before = kv_manager(llm).block_pool.get_num_free_blocks()
        released_before = release.blocks_released
        prompt = stored.prompt(1)
        second = run(llm, {"second": prompt}, 8)["second"]
        assert plans.stats["hit_chunks"] == CONTEXT // 256
        assert release.repacked_loads == 1 and release.packs == 2
        prompt_blocks = len(prompt) // BLOCK_SIZE
        final_kept = round(BUDGET * prompt_blocks)
        # every full prompt block past the final budget went back: the load's hole and the
        # stored rows and tail blocks the second pack dropped
        assert release.blocks_released - released_before == prompt_blocks - final_kept
        assert kv_manager(llm).block_pool.get_num_free_blocks() == free_before
        assert worker.pack_stats["packs"] == 2
        answer = str(tokenizer.decode(second))
        assert score_needle(answer, stored.needles[1].passkey) == 1.0, answer
