"""Window-scored decode policies (``decoding_snapkv``, ``rkv``) in vLLM's CPU engine.

SmolLM2 (real weights) generates 240 tokens after a 120-token prompt with a 192-token decode
budget (a 4-block kept region of 1 sink + 3 blocks, 2 recent blocks) and
``release.decode_policy`` naming a score policy. After every engine step the test counts the
blocks the request holds and snapshots the kept region and the first block after the hole;
when the next step merged that block, each (layer, kv head) of the kept region must hold
sinks unchanged and ``K - s`` distinct tokens of (kept region minus sinks) + that block, in
their order there. The choice itself is checked against a torch reference in
``tests/unit/compaction/test_window_merge.py``; here: the wiring (queries recorded, merges run
in the worker, blocks released, budget kept, pool whole).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from connectors.vllm.patches.kv_cache_manager import audit_pool
from tests.integration.vllm_release.harness import (
    BLOCK_SIZE,
    engine_request_ids,
    held_blocks,
    kv_manager,
    release_engine,
    run,
    scheduler,
)
from tests.integration.vllm_release.test_h2o_decode import worker
from tests.integration.vllm_release.test_long_generation import text_prompt

pytestmark = pytest.mark.integration

NEW_TOKENS = 240
BUDGET_TOKENS = 6 * BLOCK_SIZE
RECENT_TOKENS = 2 * BLOCK_SIZE


@pytest.mark.parametrize(
    ("name", "params"), [("decoding_snapkv", {"window_size": 16}), ("rkv", {"window_size": 8})]
)
def test_window_decode_policy_merges_within_budget(
    smollm2_path: Path, name: str, params: dict
) -> None:
    from lmcompact.compaction.window_merge import WindowScores

    prompt = text_prompt(smollm2_path, 120)
    extra = {
        "policy": "none",
        "store": False,
        "release": {
            "decode_budget_tokens": BUDGET_TOKENS,
            "decode_recent_tokens": RECENT_TOKENS,
            "decode_policy": name,
            "decode_policy_params": params,
        },
    }
    samples: list[int] = []
    taken: list[int] = []
    snapshot: dict[str, Any] = {}
    with release_engine(str(smollm2_path), extra, num_blocks=64, max_model_len=1024) as llm:
        start_free = kv_manager(llm).block_pool.get_num_free_blocks()
        sched = scheduler(llm).connector.scheduler
        half = worker()
        assert isinstance(half.heavy, WindowScores)
        layout, layers = half.layout, list(half.kv_caches.values())
        kept_region = (BUDGET_TOKENS - RECENT_TOKENS) // BLOCK_SIZE
        k, s, bs = kept_region * BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE

        def check_merge(req_id: str, hole: Any) -> None:
            if not snapshot or hole is None or hole.stop == snapshot["stop"]:
                return
            assert hole.start == kept_region and hole.stop == snapshot["stop"] + 1
            row = sched.ledger.block_ids(req_id)
            count = 0
            for layer, kv in enumerate(layers):
                keys, _ = layout.read(kv, row[:kept_region], 0, k)
                old = snapshot["keys"][layer]  # (H, K + bs, D): kept region + the block
                assert torch.equal(keys[:, :s], old[:, :s])  # sinks stay
                for head in range(keys.shape[0]):
                    match = (keys[head, s:, None, :] == old[head, None, s:, :]).all(dim=-1)
                    index = match.int().argmax(dim=-1)  # candidate each slot holds
                    assert bool(match.any(dim=-1).all()), (layer, head)
                    assert torch.equal(index, index.sort().values.unique_consecutive())
                    count += int((index >= k - s).sum())
            taken.append(count)

        def sample(step: int, outputs: list[Any]) -> None:
            ids = engine_request_ids(llm)
            if "long" not in ids:
                return
            req_id = ids["long"]
            samples.append(held_blocks(llm, req_id))
            hole = sched.planner.holes.get(req_id)
            check_merge(req_id, hole)
            snapshot.clear()
            row = sched.ledger.block_ids(req_id)
            if hole is None or hole.length == 0 or hole.stop >= len(row):
                return
            snapshot["stop"] = hole.stop
            candidates = [*row[:kept_region], row[hole.stop]]
            snapshot["keys"] = [layout.read(kv, candidates, 0, k + bs)[0].clone() for kv in layers]

        tokens = run(llm, {"long": prompt}, NEW_TOKENS, sample)["long"]
        assert kv_manager(llm).block_pool.get_num_free_blocks() == start_free
        assert audit_pool(kv_manager(llm)).ok
        stats = dict(half.heavy.stats)
        run(llm, {"next": prompt[:40]}, 2)
        assert not [r for r in half.heavy.queries if r.startswith("long")]  # dropped

    limit = BUDGET_TOKENS // BLOCK_SIZE + 1
    assert len(tokens) == NEW_TOKENS
    assert max(samples) <= limit and max(samples[-50:]) == limit
    full_blocks = (len(prompt) + NEW_TOKENS - 2) // BLOCK_SIZE
    assert stats["merges"] == full_blocks - BUDGET_TOKENS // BLOCK_SIZE
    assert stats["recorded"] >= NEW_TOKENS - 2  # every decode query was kept
    assert len(taken) >= stats["merges"] - 1 and sum(taken) > 0  # new tokens enter
