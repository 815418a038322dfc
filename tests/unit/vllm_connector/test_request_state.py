"""One record per request on the scheduler side, one hole model for the store and release groups.

The real-engine counterparts: ``tests/integration/vllm_release/test_store_load_release.py``
(a compacted load's hole blocks go back to the pool) and ``test_memory_accounting.py``
(preemptions, aborts: every record and hole forgotten).
"""

from __future__ import annotations

import pytest

from connectors.vllm.metadata import LMCompactMetadata, WorkerReport
from connectors.vllm.requests import HoleState, RequestState, RequestStates
from connectors.vllm.scheduler import Scheduler
from lmcompact.compaction.holes import Hole
from tests.unit.vllm_connector import fakes

CHUNK, BS = 64, 32
STORE = {"policy": "snapkv", "budget": 0.5, "store": {"chunk_size": CHUNK}}
RELEASE = {"prefill": "pack", "decode_budget_tokens": 4 * BS}


def _scheduler(
    release: bool = False, prefix_caching: bool = False
) -> tuple[Scheduler, fakes.Manager]:
    """A scheduler side bound to a stand-in of vLLM's KV-cache manager."""
    extra = {**STORE, "release": RELEASE} if release else STORE
    scheduler = fakes.scheduler(extra, block_size=BS, prefix_caching=prefix_caching)
    manager = fakes.Manager(block_size=BS, prefix_caching=prefix_caching)
    scheduler.bind_manager(manager)
    return scheduler, manager


def _loaded(
    scheduler: Scheduler, manager: fakes.Manager, prompt: list[int], hit: int = 0
) -> LMCompactMetadata:
    """Schedule request "a" with its stored chunks after vLLM's own ``hit`` tokens loaded, as
    vLLM's scheduler does (lookup, allocation, confirmation, step metadata)."""
    scheduler.take_report(WorkerReport(saved=set(scheduler.keyer.keys(prompt))))
    request = fakes.request("a", prompt)
    loaded = (len(prompt) - 1) // CHUNK * CHUNK - hit
    assert scheduler.num_new_matched_tokens(request, hit) == loaded
    assert manager.allocate_slots(request, len(prompt)) is not None
    scheduler.after_alloc(request, loaded)
    computed = hit + loaded
    step = fakes.output(
        [fakes.new(request, manager.row("a"), computed)], scheduled={"a": len(prompt) - computed}
    )
    envelope = scheduler.build_connector_meta(step)
    request.num_computed_tokens = len(prompt)
    return envelope


def test_a_compacted_load_opens_the_one_hole_the_release_planner_sees() -> None:
    scheduler, manager = _scheduler(release=True)
    planner = scheduler.planner
    assert planner is not None and planner.holes is scheduler.states.holes
    prompt = list(range(2 * CHUNK + 1))
    envelope = _loaded(scheduler, manager, prompt)
    meta = envelope.step
    first = manager.row("a")[0]
    assert [(load.req_id, load.start) for load in meta.loads] == [("a", 0)]
    # two chunks of 2 blocks keep 1 block each: kept [0, 2), hole [2, 4); sliding layers
    # skip the first chunk's kept block too
    hole = planner.holes["a"]
    assert hole is scheduler.states["a"].hole
    assert (hole.first_block, hole.start, hole.length, hole.window_lead) == (first, 2, 2, 1)
    assert not hole.owned
    assert envelope.packs == []  # the release group packs nothing on top of it
    assert planner.prefill_end("a", len(prompt), first, step=1) is None
    assert not planner.grow_for_decode("a", first, len(prompt), 10 * BS, step=1)
    assert meta.holes == {first: Hole(first, 2, 2, 1, "a")}
    assert scheduler.states.step == 1
    # adopted by the release group, whose blocks stay until the worker confirms the load
    assert scheduler.release_stats.holes_adopted == 1
    assert scheduler.release_stats.blocks_released == 0
    # a refused load: vLLM recomputes into the blocks, the hole is gone for both groups
    scheduler.take_report(WorkerReport(loaded={"a"}, load_failed={"a"}))
    assert dict(planner.holes) == {} and scheduler.states["a"].loaded_end == 0


def test_holes_of_possibly_shared_rows_are_keyed_by_their_last_block() -> None:
    scheduler, manager = _scheduler(prefix_caching=True)
    assert scheduler.guard is not None
    # vLLM's prefix cache served the first chunk (blocks 0-1, maybe shared with another
    # request); the store loads chunks 1 and 2: the request is frozen from block 2 on
    envelope = _loaded(scheduler, manager, list(range(3 * CHUNK + 1)), hit=CHUNK)
    assert scheduler.states["a"].frontier == 2
    row = manager.row("a")
    # kept [2, 4), hole [4, 6); key length 193 tokens: the last block is column 6
    assert envelope.step.holes == {row[6]: Hole(row[6], 4, 2, 3, "a", key_column=6)}


def test_holes_of_unscheduled_or_future_steps_are_not_sent() -> None:
    scheduler, manager = _scheduler()
    scheduler.states.add("b", RequestState(prompt=[1], keys=[]))
    scheduler.states["b"].hole = HoleState(20, 1, 2, visible_from=0)  # live, not scheduled
    prompt = list(range(2 * CHUNK + 1))
    assert 20 not in _loaded(scheduler, manager, prompt).step.holes  # b: visible, not scheduled
    first = manager.row("a")[0]
    step = scheduler.states.step
    scheduler.states["a"].hole = HoleState(first, 2, 2, visible_from=step + 1)  # next step
    running = fakes.output(cached={"a": (len(prompt), [])})
    assert scheduler.build_connector_meta(running).step.holes == {}
    assert scheduler.states.step == step + 1


def test_one_forget_path() -> None:
    scheduler, manager = _scheduler()
    prompt = list(range(2 * CHUNK + 1))
    _loaded(scheduler, manager, prompt)
    state = scheduler.states["a"]
    state.released_to, state.freed, state.packed = 4, 2, True
    # preempted: the blocks went back, the request stays (it resumes); the worker hears it
    meta = scheduler.build_connector_meta(fakes.output(preempted={"a"})).step
    assert meta.taken_back == {"a"} and not meta.is_idle()
    assert state.hole is None and state.load_start is None and state.released_to is None
    assert state.freed == 0 and state.packed and state.prompt == prompt
    assert "a" in scheduler.states
    scheduler.build_connector_meta(fakes.output(finished={"a"}))
    assert "a" not in scheduler.states and dict(scheduler.states.holes) == {}


def test_a_hole_needs_a_record() -> None:
    states = RequestStates()
    with pytest.raises(KeyError, match="no request state"):
        states.holes["x"] = HoleState(1, 1, 1, visible_from=0)
    states.add("x", RequestState(prompt=[], keys=[]))
    states.holes["x"] = HoleState(1, 1, 1, visible_from=0)
    assert list(states.holes) == ["x"] and len(states.holes) == 1
    del states.holes["x"]
    assert states["x"].hole is None and "x" in states
