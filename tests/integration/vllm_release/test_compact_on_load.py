"""``"compact_on": "load"`` in a real vLLM CPU engine with SmolLM2 (float32).

Request 1 (the context and a first question) stores the context whole; request 2 asks
another question about the same context: it must hit the store for every context chunk,
get packed in place at its prefill end with the question as the observation window (its
hole blocks go back to the pool) and still answer right. The store holds whole chunks in
the namespace of policy ``none`` (never compacted entries).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmcompact.eval.tasks import build_stored_context, score_needle
from lmcompact.eval.text import text_stream
from tests.integration.vllm.tiny_model import build_tiny_llama
from tests.integration.vllm_release.harness import (
    BLOCK_SIZE,
    kv_manager,
    release_engine,
    run,
    scheduler,
)

pytestmark = pytest.mark.integration

CONTEXT = 1024  # 4 chunks of 256
EXTRA: dict[str, Any] = {
    "policy": "snapkv",
    "budget": 0.5,  # at 0.25 this prompt's answer loses digits, in place and at load alike
    "store": {"compact_on": "load", "async_save": False},
    "release": {"prefill": "pack"},
}


def test_stored_whole_then_packed_at_load(smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    from connectors.vllm.offline import worker_connector

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    stored = build_stored_context(tokenizer, CONTEXT, 1, [0.25, 0.75], text_stream(1))
    with release_engine(str(smollm2_path), EXTRA, max_model_len=1536) as llm:
        connector = scheduler(llm).connector
        lookups = connector.scheduler
        release = lookups.release_stats
        worker = worker_connector().worker
        assert connector.spec.namespaces[0].policy_name == "none"

        first = run(llm, {"first": stored.prompt(0)}, 8)["first"]
        assert lookups.stats["hit_chunks"] == 0
        assert worker.stats["saved_chunks"] == CONTEXT // 256
        keys = lookups.keyer.keys(stored.context_ids)
        chunks = connector.store.get_many(keys)
        assert len(chunks) == CONTEXT // 256
        assert all(c is not None and c.uniform_count() == c.num_tokens == 256 for c in chunks)
        assert release.packs == 1  # request 1 itself runs packed after its prefill
        assert score_needle(str(tokenizer.decode(first)), stored.needles[0].passkey) == 1.0

        free_before = kv_manager(llm).block_pool.get_num_free_blocks()
        released_before = release.blocks_released
        prompt = stored.prompt(1)
        second = run(llm, {"second": prompt}, 8)["second"]
        assert lookups.stats["hit_chunks"] == CONTEXT // 256  # the whole context came back
        assert release.packs == 2
        prompt_blocks = len(prompt) // BLOCK_SIZE
        hole = prompt_blocks - round(0.5 * prompt_blocks)
        assert release.blocks_released - released_before == hole
        assert kv_manager(llm).block_pool.get_num_free_blocks() == free_before
        answer = str(tokenizer.decode(second))
        assert score_needle(answer, stored.needles[1].passkey) == 1.0, answer


@pytest.mark.parametrize(
    ("policy", "release", "match"),
    [
        ("snapkv", False, "packs prompts"),
        ("snapkv", {"prefill": "off"}, "release.prefill must be"),
        ("kvzip", {"prefill": "pack"}, "does not compute"),
    ],
)
def test_load_needs_an_in_place_pack(
    tmp_path: Path,
    policy: str,
    release: dict[str, str] | bool,
    match: str,
) -> None:
    model = str(build_tiny_llama(tmp_path / "llama"))
    extra: dict[str, Any] = {"policy": policy, "budget": 0.5, "store": {"compact_on": "load"}}
    extra["release"] = release
    with pytest.raises(Exception, match=match), release_engine(model, extra):
        pass
