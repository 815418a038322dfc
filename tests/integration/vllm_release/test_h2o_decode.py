"""H2O decode in vLLM's CPU engine: within budget + one block, heavy hitters really kept.

SmolLM2 (real weights) generates 240 tokens after a 120-token prompt with a 192-token
decode budget (6 blocks: a 4-block kept region of 1 sink + 3 heavy-hitter blocks, 2 recent
blocks). After every engine step the test counts the blocks the request holds, and
snapshots the worker's accumulated scores and the K/V of the kept region and of the first
block after the hole. When the next step merged that block, the kept region must hold, per
(layer, kv head), exactly the top-scored tokens of (kept region minus sinks) + that block
by the snapshot's scores, recomputed here independently of the merge code.

With vLLM's prefix caching on (checked every step: no rewritten block is hashed), the same
holds for a request that owns its blocks; two requests that share their first blocks (a
prefix hit) decode without scores or merges (their kept region is shared) and stay within
the budget all the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from connectors.vllm.patches.kv_cache_manager import audit_pool
from tests.integration.vllm_release.harness import (
    BLOCK_SIZE,
    CONNECTOR,
    engine_request_ids,
    held_blocks,
    kv_manager,
    release_engine,
    run,
    scheduler,
)
from tests.integration.vllm_release.test_long_generation import text_prompt

pytestmark = pytest.mark.integration

CHECKED = ("PrefixCheckedConnector", "tests.integration.vllm.prefix_checked")
NEW_TOKENS = 240
BUDGET_TOKENS = 6 * BLOCK_SIZE
RECENT_TOKENS = 2 * BLOCK_SIZE
SINKS = 1


def extra(decode_policy: str) -> dict[str, Any]:
    release: dict[str, Any] = {
        "decode_budget_tokens": BUDGET_TOKENS,
        "decode_policy": decode_policy,
    }
    if decode_policy == "h2o":
        release["decode_recent_tokens"] = RECENT_TOKENS
    return {"policy": "none", "store": False, "release": release}


def worker() -> Any:
    """The in-process worker-side connector's :class:`connectors.vllm.worker.Worker`."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["nocache", "prefix-cache"])
def test_h2o_keeps_budget_and_the_top_scored_tokens(
    smollm2_path: Path, prefix_caching: bool
) -> None:
    prompt = text_prompt(smollm2_path, 120)
    samples: list[int] = []
    checked: list[int] = []  # per checked merge: tokens the kept region took from the block
    snapshot: dict[str, Any] = {}
    connector = CHECKED if prefix_caching else CONNECTOR
    with release_engine(
        str(smollm2_path),
        extra("h2o"),
        num_blocks=64,
        max_model_len=1024,
        prefix_caching=prefix_caching,
        connector=connector,
    ) as llm:
        start_free = kv_manager(llm).block_pool.get_num_free_blocks()
        sched = scheduler(llm).connector.scheduler
        half = worker()
        layout, layers = half.layout, list(half.kv_caches.values())
        kept_region = (BUDGET_TOKENS - RECENT_TOKENS) // BLOCK_SIZE  # blocks, sinks included
        k, s, bs = kept_region * BLOCK_SIZE, SINKS * BLOCK_SIZE, BLOCK_SIZE

        def check_merge(req_id: str, hole: Any) -> None:
            if not snapshot or hole is None or hole.stop == snapshot["stop"]:
                return
            assert hole.start == kept_region and hole.stop == snapshot["stop"] + 1
            row = sched.ledger.block_ids(req_id)
            taken = 0
            for layer, kv in enumerate(layers):
                keys, values = layout.read(kv, row[:kept_region], s, k - s)
                old_k, old_v = snapshot["kv"][layer]  # (H, K - s + bs, D) candidates
                for head in range(keys.shape[0]):
                    scores = snapshot["scores"][layer, head, s : k + bs]
                    top = torch.topk(scores, k - s).indices.sort().values
                    assert torch.equal(keys[head], old_k[head, top]), (layer, head)
                    assert torch.equal(values[head], old_v[head, top]), (layer, head)
                    taken += int((top >= k - s).sum())
            checked.append(taken)

        def sample(step: int, outputs: list[Any]) -> None:
            ids = engine_request_ids(llm)
            if "long" not in ids:
                return
            req_id = ids["long"]
            samples.append(held_blocks(llm, req_id))
            hole = sched.planner.holes.get(req_id)
            check_merge(req_id, hole)
            snapshot.clear()
            scores = half.heavy.scores.get(req_id)
            if hole is None or scores is None or scores.shape[2] < k + bs:
                return
            row = sched.ledger.block_ids(req_id)
            if hole.stop >= len(row):  # the first block after the hole is not allocated yet
                return
            candidates = [*row[:kept_region], row[hole.stop]]
            snapshot["stop"] = hole.stop
            snapshot["scores"] = scores.clone()
            snapshot["kv"] = []
            for kv in layers:
                keys, values = layout.read(kv, candidates, s, k - s + bs)
                snapshot["kv"].append((keys.clone(), values.clone()))

        tokens = run(llm, {"long": prompt}, NEW_TOKENS, sample)["long"]
        assert kv_manager(llm).block_pool.get_num_free_blocks() == start_free
        assert audit_pool(kv_manager(llm)).ok
        # the worker drops a finished request's scores with the next step's metadata
        long_ids = [r for r in half.heavy.scores if r.startswith("long")]
        run(llm, {"next": prompt[:40]}, 2)
        assert long_ids and not set(long_ids) & set(half.heavy.scores)
        merges = half.heavy.stats["merges"]
        if prefix_caching:
            twins = {"a": prompt, "b": prompt[:64] + prompt[64:][::-1]}  # share 2 blocks
            held: list[int] = []

            def watch(step: int, outputs: list[Any]) -> None:
                held.extend(held_blocks(llm, rid) for rid in engine_request_ids(llm).values())

            twin_tokens = run(llm, twins, NEW_TOKENS, watch)
            assert half.heavy.stats["merges"] == merges  # shared kept region: no merge
            assert all(len(t) == NEW_TOKENS for t in twin_tokens.values())
            assert max(held) <= BUDGET_TOKENS // BLOCK_SIZE + 1
            checker = scheduler(llm).connector
            assert checker.steps_checked > 0
            assert max(n for r, n in checker.local_hits.items() if r.startswith("b-")) >= 64

    limit = BUDGET_TOKENS // BLOCK_SIZE + 1
    assert len(tokens) == NEW_TOKENS
    assert len(samples) >= NEW_TOKENS - 1
    assert max(samples) <= limit, f"held {max(samples)} blocks, budget + 1 is {limit}"
    assert max(samples[-50:]) == limit
    full_blocks = (len(prompt) + NEW_TOKENS - 2) // BLOCK_SIZE  # KV written by the end
    assert merges == full_blocks - BUDGET_TOKENS // BLOCK_SIZE  # one merge per evicted block
    assert len(checked) >= merges - 1  # every merge but possibly the last was checked
    # heavy hitters really change: new tokens enter the kept region, old ones leave
    assert sum(checked) > 0


def test_recent_decode_policy_is_streaming_llm(smollm2_path: Path) -> None:
    prompt = text_prompt(smollm2_path, 120)
    starts: set[int] = set()
    samples: list[int] = []
    merges: list[Any] = []  # H2O merges of every step's metadata (none for "recent")
    with release_engine(
        str(smollm2_path), extra("recent"), num_blocks=64, max_model_len=1024
    ) as llm:
        sched = scheduler(llm).connector.scheduler
        assert worker().heavy is None
        build = sched.build_connector_meta

        def build_and_keep(scheduler_output: Any) -> Any:
            envelope = build(scheduler_output)
            merges.extend(envelope.merges)
            return envelope

        sched.build_connector_meta = build_and_keep

        def sample(step: int, outputs: list[Any]) -> None:
            ids = engine_request_ids(llm)
            if "long" in ids:
                samples.append(held_blocks(llm, ids["long"]))
                hole = sched.planner.holes.get(ids["long"])
                if hole is not None and hole.length:
                    starts.add(hole.start)

        run(llm, {"long": prompt}, 200, sample)
    assert merges == []
    assert starts == {SINKS}  # the hole follows the sinks: the oldest block simply leaves
    assert max(samples) == BUDGET_TOKENS // BLOCK_SIZE + 1
