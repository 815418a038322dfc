"""Per-head kept counts in the real vLLM CPU engine (Ada-KV and PyramidKV over SnapKV scores).

One engine run per policy: two prompts are packed at prefill end with each (layer, head)'s
own count (``release.per_head``) as dense cells of the reserved blocks (for Ada-KV the blocks
a uniform count would hold), the hole blocks go back to the pool, and generation continues.
For every decode step of one layer the test keeps vLLM's own attention output (which reads
the cells as if they were every head's slots), the output after the connector's recompute,
the queries and a copy of the request's pages. Afterwards, attention computed directly from
those pages with each head's own count (the cells read back, dense softmax, no paged code)
must equal the recomputed rows and differ from vLLM's own rows: the comparison can fail
either way.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from connectors.vllm.patches.kv_cache_manager import audit_pool
from lmcompact.compaction.per_head import masked_decode_attention
from lmcompact.testing.attention_probes import PerHeadRecorder, dense_reference
from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_release.harness import (
    BLOCK_SIZE,
    engine_request_ids,
    held_blocks,
    kv_manager,
    release_engine,
    run,
    scheduler,
)

pytestmark = pytest.mark.integration

PROMPTS = {"a": tiny_prompt_ids(520, seed=21), "b": tiny_prompt_ids(460, seed=22)}
NEW_TOKENS = 6
LAYER = 1
PER_HEAD = {
    # per-layer budgets summing to the mean: dense cells at the uniform footprint
    "adakv": {"slack": 1.5},
    # one count per layer, lower layers above the mean: their cells need a layer slack
    "pyramidkv": {"slack": 2, "layer_slack": 1.5},
}


def extra(policy: str) -> dict[str, Any]:
    return {
        "policy": policy,
        "budget": 0.25,
        "window": 16,
        "store": False,
        "release": {"prefill": "pack", "per_head": PER_HEAD[policy]},
    }


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.mark.parametrize("policy", sorted(PER_HEAD))
def test_per_head_counts_free_blocks_and_recompute_masked_attention(
    tiny_model: str, policy: str
) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    slack = float(PER_HEAD[policy]["slack"])
    layer_slack = float(PER_HEAD[policy].get("layer_slack", 1.0))
    config = extra(policy)
    with release_engine(tiny_model, config, num_blocks=64, max_num_batched_tokens=1024) as llm:
        manager = kv_manager(llm)
        start_free = manager.block_pool.get_num_free_blocks()
        connector = get_kv_transfer_group()
        perhead = connector.worker.perhead
        assert perhead is not None
        recorder = PerHeadRecorder(connector.worker, [LAYER])
        recorder.install()
        sched = scheduler(llm).connector.scheduler
        held: dict[str, list[tuple[int, int, int]]] = {r: [] for r in PROMPTS}
        counts: dict[str, torch.Tensor] = {}

        def watch(step: int, outputs: list[Any]) -> None:
            assert audit_pool(manager).ok
            for rid, engine_id in engine_request_ids(llm).items():
                hole = sched.planner.holes.get(engine_id)
                entry = perhead.entries.get(engine_id)
                if hole is not None and entry is not None:
                    counts[rid] = entry.counts.clone()
                    assert hole.start * BLOCK_SIZE == entry.reserved  # scheduler == worker
                    held[rid].append((held_blocks(llm, engine_id), hole.start, hole.length))

        tokens = run(llm, PROMPTS, NEW_TOKENS, watch)
        scale = float(connector.worker.layers[next(iter(recorder.names))].impl.scale)
        layout = connector.worker.layout
        stats = dict(perhead.stats)
        released = sched.release_stats.blocks_released
        end_free = manager.block_pool.get_num_free_blocks()
        final = audit_pool(manager)

    assert {r: len(t) for r, t in tokens.items()} == {r: NEW_TOKENS for r in PROMPTS}
    assert end_free == start_free and final.ok and final.referenced == 0
    reserved: dict[str, int] = {}
    for rid, prompt in PROMPTS.items():
        full_blocks = len(prompt) // BLOCK_SIZE
        kept_blocks = max(1, round(0.25 * full_blocks))
        # dense cells: a layer's heads share ceil(kept x layer_slack) blocks (Ada-KV at 1:
        # the uniform footprint)
        reserved_blocks = min(math.ceil(kept_blocks * layer_slack), full_blocks - 1)
        reserved[rid] = reserved_blocks
        head_cap = math.ceil(kept_blocks * BLOCK_SIZE * slack)
        c = counts[rid]
        # counts differ per (layer, head), each within its cap, each layer's within its
        # cells, and average the budget
        assert c.unique().numel() > 1 and int(c.max()) <= head_cap
        assert int(c.sum(dim=1).max()) <= reserved_blocks * BLOCK_SIZE * c.shape[1]
        assert int(c.max()) > kept_blocks * BLOCK_SIZE  # some head holds more than a block row
        assert kept_blocks * BLOCK_SIZE <= float(c.float().mean()) < (kept_blocks + 1) * BLOCK_SIZE
        # sampled after each step; the hole's blocks go back from the step after the pack
        assert len(held[rid]) >= 2, f"{rid} never decoded with a visible hole"
        assert held[rid][0][0] == -(-(len(prompt) + 1) // BLOCK_SIZE)
        tail_blocks = -(-(len(prompt) + NEW_TOKENS) // BLOCK_SIZE) - full_blocks
        for blocks, start, length in held[rid][1:]:
            assert start == reserved_blocks and length == full_blocks - reserved_blocks
            assert blocks <= reserved_blocks + tail_blocks  # the hole's blocks went back
    assert released == sum(len(p) // BLOCK_SIZE - reserved[r] for r, p in PROMPTS.items())

    calls = recorder.calls
    assert len({c.req_id for c in calls}) == 2 and len(calls) >= 2 * (NEW_TOKENS - 1)
    assert stats["calls"] >= len(calls) and stats["requests"] == 2
    gap_vllm = 0.0
    for call in calls:
        want = dense_reference(call, layout, scale).to(call.out.dtype)
        torch.testing.assert_close(call.out, want, rtol=1e-4, atol=1e-5)
        paged = masked_decode_attention(
            call.queries,
            call.pages,
            layout,
            list(range(call.pages.shape[0])),
            call.counts,
            call.reserved,
            call.seq_len,
            scale,
            reserved=call.reserved,
        )
        torch.testing.assert_close(call.out, paged, rtol=1e-4, atol=1e-5)
        gap_vllm = max(gap_vllm, float((call.vllm_out - want).abs().max()))
    # vLLM's own rows read the cells as if they were every head's slots: the recompute
    # changed them
    assert gap_vllm > 1e-3
