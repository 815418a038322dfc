"""One record per request on the scheduler side, one hole model for the store and release groups.

The real-engine counterparts: ``tests/integration/vllm_memory/test_store_load_release.py``
(a compacted load's hole blocks go back to the pool) and ``test_memory_accounting.py``
(preemptions, aborts: every record and hole forgotten).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcompact.store import ChunkKeyer, StoreConfig, StoreNamespace, TieredStore
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.holes import Hole
from lmcompact.vllm.memory.planner import HolePlanner, PrefillMode
from lmcompact.vllm.metadata import WorkerReport
from lmcompact.vllm.request_state import HoleState, RequestState, RequestStates
from lmcompact.vllm.scheduler_side import SchedulerHalf

CHUNK, BS = 64, 32
ROW = [11, 12, 13, 14, 15]


def _half() -> SchedulerHalf:
    namespace = StoreNamespace(
        model_id="tiny", kv_dtype="float32", kv_layout="rows", policy_name="snapkv"
    )
    facts = shim.EngineFacts(
        model_id="tiny", block_size=BS, num_layers=2, num_kv_heads=1, head_dim=8,
        dtype=torch.float32, prefix_caching=False, device_type="cpu", tp_size=1,
    )  # fmt: skip
    config = ConnectorConfig.from_extra({"policy": "snapkv", "chunk_size": CHUNK, "budget": 0.5})
    store = TieredStore(namespace, StoreConfig(cpu_capacity_bytes=1 << 24))
    return SchedulerHalf(config, facts, store, ChunkKeyer(namespace, CHUNK))


def _output(new: list[Any] | None = None, **kwargs: Any) -> SimpleNamespace:
    """A ``SchedulerOutput`` with the fields the shim reads."""
    new = new or []
    cached = SimpleNamespace(
        req_ids=[], num_computed_tokens=[], new_block_ids=[], resumed_req_ids=set()
    )
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={r.req_id: 1 for r in new},
        finished_req_ids=kwargs.get("finished", set()),
        preempted_req_ids=kwargs.get("preempted", set()),
    )


def _loaded(half: SchedulerHalf, prompt: list[int]) -> Any:
    """Schedule request "a" with its two stored chunks loaded; return the step's metadata."""
    half.take_report(WorkerReport(saved=set(half.keyer.keys(prompt))))
    request = SimpleNamespace(request_id="a", prompt_token_ids=prompt, kv_transfer_params=None)
    assert half.num_new_matched_tokens(request, 0) == 2 * CHUNK
    half.after_alloc(request, 2 * CHUNK)
    new = SimpleNamespace(
        req_id="a", num_computed_tokens=2 * CHUNK, block_ids=(ROW,), prompt_token_ids=prompt
    )
    return half.build_metadata(_output([new]))


def test_a_compacted_load_opens_the_one_hole_the_release_planner_sees() -> None:
    half = _half()
    planner = HolePlanner(
        BS, PrefillMode.PACK, 0.5, decode_budget_blocks=4, holes=half.states.holes
    )
    prompt = list(range(2 * CHUNK + 1))
    meta = _loaded(half, prompt)
    assert [(load.req_id, load.start) for load in meta.loads] == [("a", 0)]
    # two chunks of 2 blocks keep 1 block each: kept [0, 2), hole [2, 4); sliding layers
    # skip the first chunk's kept block too
    hole = planner.holes["a"]
    assert hole is half.states["a"].hole
    assert (hole.first_block, hole.start, hole.length, hole.window_lead) == (11, 2, 2, 1)
    assert not hole.owned
    assert planner.prefill_end("a", len(prompt), 11, step=0) is None  # no pack on top of it
    assert not planner.grow_for_decode("a", 11, len(prompt), 10 * BS, step=0)
    half.end_step(meta)
    assert meta.holes == {11: Hole(11, 2, 2, 1, "a")}
    assert half.states.step == 1
    # a refused load: vLLM recomputes into the blocks, the hole is gone for both groups
    half.take_report(WorkerReport(loaded={"a"}, load_failed={"a"}))
    assert dict(planner.holes) == {} and half.states["a"].loaded_end == 0


def test_holes_of_possibly_shared_rows_are_keyed_by_their_last_block() -> None:
    half = _half()
    meta = _loaded(half, list(range(2 * CHUNK + 1)))
    half.end_step(meta, frontier=lambda req_id: 1)
    # key length 129 tokens: the last block is column 4
    assert meta.holes == {15: Hole(15, 2, 2, 1, "a", key_column=4)}


def test_holes_of_unscheduled_or_future_steps_are_not_sent() -> None:
    half = _half()
    half.states.add("b", RequestState(prompt=[1], keys=[]))
    half.states["b"].hole = HoleState(20, 1, 2, visible_from=0)  # live, not scheduled
    meta = _loaded(half, list(range(2 * CHUNK + 1)))
    half.states["a"].hole = HoleState(11, 2, 2, visible_from=1)  # visible from next step
    half.end_step(meta)
    assert meta.holes == {}


def test_one_forget_path() -> None:
    half = _half()
    prompt = list(range(2 * CHUNK + 1))
    _loaded(half, prompt)
    state = half.states["a"]
    state.released_to, state.freed, state.packed = 4, 2, True
    # preempted: the blocks went back, the request stays (it resumes); the worker hears it
    meta = half.build_metadata(_output(preempted={"a"}))
    assert meta.taken_back == {"a"} and not meta.is_idle()
    assert state.hole is None and state.load_start is None and state.released_to is None
    assert state.freed == 0 and state.packed and state.prompt == prompt
    assert "a" in half.states
    half.build_metadata(_output(finished={"a"}))
    assert "a" not in half.states and dict(half.states.holes) == {}


def test_a_hole_needs_a_record() -> None:
    states = RequestStates()
    with pytest.raises(KeyError, match="no request state"):
        states.holes["x"] = HoleState(1, 1, 1, visible_from=0)
    states.add("x", RequestState(prompt=[], keys=[]))
    states.holes["x"] = HoleState(1, 1, 1, visible_from=0)
    assert list(states.holes) == ["x"] and len(states.holes) == 1
    del states.holes["x"]
    assert states["x"].hole is None and "x" in states
