"""A prefix loaded compacted from the store gives its hole blocks back to the pool.

The base connector loads a stored, compacted prefix packed into the request's first
blocks and skips the rest (the hole) in attention; vLLM still allocates the full-length
blocks at admission. The release group gives that hole's blocks back (the store half opened
the hole in the request's one record, where the release group finds it) in the first
scheduling pass after the worker reported the load written. Checked: the request
holds fewer blocks while it decodes, the pool balances, and garbage written into every
free block after each step changes nothing in its output.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from connectors.vllm.patches.kv_cache_manager import audit_pool
from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_release.harness import (
    BLOCK_SIZE,
    engine_request_ids,
    held_blocks,
    kv_layers,
    kv_manager,
    release_engine,
    run,
    scheduler,
)

pytestmark = pytest.mark.integration

PROMPT = tiny_prompt_ids(300, seed=21)  # 4 chunks of 64 stored; 44 tokens computed
EXTRA = {
    "policy": "snapkv",
    "budget": 0.5,
    "window": 16,
    "store": {"chunk_size": 64, "async_save": False},
    "release": {"prefill": "off"},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


def test_loaded_hole_blocks_return_to_pool(tiny_model: str) -> None:
    with release_engine(tiny_model, EXTRA, num_blocks=64, max_model_len=1024) as llm:
        manager = kv_manager(llm)
        start = manager.block_pool.get_num_free_blocks()
        stats = scheduler(llm).connector.scheduler.release_stats
        run(llm, {"store": PROMPT}, 4)  # computes the prompt, stores 4 compacted chunks
        assert stats.holes_adopted == 0

        gen = torch.Generator().manual_seed(0)
        results: dict[str, list[int]] = {}
        for name, poison in (("load", False), ("load_poisoned", True)):
            held: list[int] = []

            def hook(
                step: int,
                outputs: list[Any],
                name: str = name,
                poison: bool = poison,
                held: list[int] = held,
            ) -> None:
                ids = engine_request_ids(llm)
                if name in ids:
                    held.append(held_blocks(llm, ids[name]))
                assert audit_pool(manager).ok
                if poison:
                    free = [
                        b.block_id
                        for b in manager.block_pool.free_block_queue.get_all_free_blocks()
                    ]
                    index = torch.tensor(free, dtype=torch.int64)
                    for kv in kv_layers(llm):
                        kv[index] = (torch.randn(kv[index].shape, generator=gen) * 50).to(kv.dtype)

            results[name] = run(llm, {name: PROMPT}, 24, hook)[name]
            full = -(-(len(PROMPT) + 24) // BLOCK_SIZE)
            hole = 4 * 32 // BLOCK_SIZE  # 4 chunks x (64 - 32) dropped tokens
            # the load's own step holds the whole row: the hole goes back once the worker
            # confirmed the load (a refused load is recomputed into those blocks)
            assert len(held) > 1 and held[0] <= full, (held, full)
            assert max(held[1:]) <= full - hole, (held, full, hole)
        assert stats.holes_adopted == 2
        assert results["load"] == results["load_poisoned"]
        assert manager.block_pool.get_num_free_blocks() == start
