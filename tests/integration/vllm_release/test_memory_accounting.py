"""Block accounting of the connector's release group under load: packs, holes, aborts, preemption.

A pool far too small for the workload forces vLLM to preempt (and later recompute)
compacted requests when the admission reserve is off (``reserve_growth: false``); with it on
(the default) the same workload runs without any preemption or re-pack. Some requests are
aborted mid-prefill and mid-decode. After every engine step the pool must be consistent (no
block both free and held, reference counts equal to holders), and at the end every block is
free again. The same workload then runs
with every free block overwritten by garbage after each step: identical tokens show that
attention never reads a block that went back to the pool.

With vLLM's prefix caching on, a third of the prompts start with another prompt's first 128
tokens (vLLM hits, blocks shared while packs run); the checked connector
(:mod:`tests.integration.vllm.prefix_checked`) asserts at every step that no block a pack
rewrote, or computed after a hole, is hashed; garbage goes only into free blocks without a
hash (a hashed free block is a cache entry a later request may hit, and must stay exact).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from connectors.vllm.patches.kv_cache_manager import audit_pool
from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_release.harness import (
    CONNECTOR,
    kv_layers,
    kv_manager,
    release_engine,
    run,
    scheduler,
)

pytestmark = pytest.mark.integration
CHECKED = ("PrefixCheckedConnector", "tests.integration.vllm.prefix_checked")

NUM_BLOCKS = 30
LENGTHS = [400, 260, 520, 300, 610, 350, 470, 280, 560, 330, 420, 500]
PROMPTS = {f"q{i}": tiny_prompt_ids(n, seed=100 + i) for i, n in enumerate(LENGTHS)}
SHARED = 64  # with prefix caching, these prompts start with the previous prompt's tokens
SHARING = {f"q{i}": PROMPTS[f"q{i - 1}"][:SHARED] + PROMPTS[f"q{i}"][SHARED:] for i in (4, 10)}
MAX_TOKENS = {rid: 120 + 15 * i for i, rid in enumerate(PROMPTS)}
ABORTS = {2: ["q11"], 6: ["q3"], 14: ["q7"]}  # engine step -> requests aborted after it


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


class Watch:
    """Per-step checks, aborts and (optionally) garbage in free blocks that hold no
    prefix-cache entry."""

    def __init__(self, llm: Any, poison: bool) -> None:
        self.llm = llm
        self.poison = poison
        self.problems: list[str] = []
        self.preemptions = 0
        self.aborted: list[str] = []
        self.min_free = NUM_BLOCKS
        self.cached_tokens: dict[str, int] = {}  # request -> tokens vLLM's cache served
        sched = scheduler(llm)
        original = sched._preempt_request

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.preemptions += 1
            return original(request, *args, **kwargs)

        sched._preempt_request = counting
        self.gen = torch.Generator().manual_seed(7)

    def __call__(self, step: int, outputs: list[Any]) -> None:
        for out in outputs:
            if out.num_cached_tokens:
                self.cached_tokens[out.request_id] = out.num_cached_tokens
        manager = kv_manager(self.llm)
        audit = audit_pool(manager)
        if not audit.ok:
            self.problems.append(f"step {step}: {audit}")
        self.min_free = min(self.min_free, audit.num_free)
        for req_id in ABORTS.get(step, []):
            self.llm.llm_engine.abort_request([req_id])
            self.aborted.append(req_id)
        if self.poison:
            free = [
                b.block_id
                for b in manager.block_pool.free_block_queue.get_all_free_blocks()
                if b.block_hash is None
            ]
            index = torch.tensor(free, dtype=torch.int64)
            for kv in kv_layers(self.llm):
                noise = torch.randn(kv[index].shape, generator=self.gen) * 50.0
                kv[index] = noise.to(kv.dtype)


@pytest.mark.parametrize(
    "extra",
    [
        {
            "policy": "snapkv",
            "budget": 0.25,
            "window": 16,
            "release": {"prefill": "pack", "reserve_growth": False},
        },
        {
            "policy": "streaming_llm",
            "budget": 0.5,
            "release": {
                "prefill": "blocks",
                "decode_budget_tokens": 320,
                "reserve_growth": False,
            },
        },
        {
            "policy": "adakv",
            "budget": 0.25,
            "window": 16,
            "release": {"prefill": "pack", "per_head": {"slack": 1.5}, "reserve_growth": False},
        },
    ],
    ids=["snapkv-pack", "streaming-blocks-decode", "adakv-per-head"],
)
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["nocache", "prefix-cache"])
def test_pool_balanced_after_compaction_aborts_and_preemption(
    tiny_model: str, extra: dict, prefix_caching: bool
) -> None:
    extra = {"store": False, **extra}
    prompts = {**PROMPTS, **SHARING} if prefix_caching else PROMPTS
    with release_engine(
        tiny_model,
        extra,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=256,
        max_model_len=928,
        prefix_caching=prefix_caching,
        connector=CHECKED if prefix_caching else CONNECTOR,
    ) as llm:
        manager = kv_manager(llm)
        start_free = manager.block_pool.get_num_free_blocks()
        watch = Watch(llm, poison=False)
        tokens = run(llm, prompts, MAX_TOKENS, watch)
        connector = scheduler(llm).connector
        stats = connector.scheduler.release_stats

        assert watch.problems == []
        assert manager.block_pool.get_num_free_blocks() == start_free == NUM_BLOCKS - 1
        final = audit_pool(manager)
        assert final.ok and final.referenced == 0
        assert watch.preemptions > 0, "the pool was meant to force preemption"
        assert sorted(watch.aborted) == ["q11", "q3", "q7"]
        assert set(tokens) == set(prompts) - set(watch.aborted)
        assert all(len(tokens[r]) == MAX_TOKENS[r] for r in tokens)
        assert stats.blocks_released > 0
        assert connector.scheduler.planner.holes == {}
        if prefix_caching:
            assert connector.steps_checked > 0 and connector.compacted_seen
            # every frontier ended with its request (records of finished requests are gone)
            assert connector.scheduler.guard is not None
            frontiers = {
                rid: record.frontier
                for rid, record in connector.scheduler.states.items()
                if record.frontier is not None
            }
            assert frontiers == {}
            assert watch.cached_tokens, "a prompt sharing another's first blocks hits vLLM"

        poisoned = Watch(llm, poison=True)
        again = run(
            llm,
            {f"{r}b": ids for r, ids in prompts.items()},
            {f"{r}b": n for r, n in MAX_TOKENS.items()},
            _renamed(poisoned),
        )
        assert poisoned.problems == []
        assert {r: again[f"{r}b"] for r in tokens} == tokens
        assert manager.block_pool.get_num_free_blocks() == start_free


def _renamed(watch: Watch) -> Any:
    """The same per-step hook for the second run, whose request ids end in ``b``."""
    plan = {step: [f"{r}b" for r in ids] for step, ids in ABORTS.items()}

    def hook(step: int, outputs: list[Any]) -> None:
        saved = dict(ABORTS)
        ABORTS.clear()
        ABORTS.update(plan)
        try:
            watch(step, outputs)
        finally:
            ABORTS.clear()
            ABORTS.update(saved)

    return hook


def test_reserve_growth_prevents_preemption_and_repacks(tiny_model: str) -> None:
    """The workload that preempts above, without aborts: with the admission reserve on,
    no request is preempted or packed twice, and the pool is whole at the end."""
    extra = {
        "store": False,
        "policy": "snapkv",
        "budget": 0.25,
        "window": 16,
        "release": {"prefill": "pack"},
    }
    with release_engine(
        tiny_model, extra, num_blocks=NUM_BLOCKS, max_num_batched_tokens=256, max_model_len=928
    ) as llm:
        manager = kv_manager(llm)
        watch = Watch(llm, poison=False)
        problems: list[str] = []

        def audit(step: int, outputs: list[Any]) -> None:
            report = audit_pool(manager)
            if not report.ok:
                problems.append(f"step {step}: {report}")

        tokens = run(llm, PROMPTS, MAX_TOKENS, audit)
        stats = scheduler(llm).connector.scheduler.release_stats
        assert problems == []
        assert watch.preemptions == 0 and stats.preemptions == 0
        assert stats.packs == len(PROMPTS) and stats.repacks == 0
        assert stats.admissions_deferred > 0  # the reserve did hold requests back
        assert all(len(tokens[r]) == MAX_TOKENS[r] for r in PROMPTS)
        assert manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
