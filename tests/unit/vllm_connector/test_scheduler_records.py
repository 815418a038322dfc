"""The connector's scheduler side keeps one record per request, and the spec is built once.

Every attribute of a :class:`~connectors.vllm.scheduler.Scheduler` is listed here with what it
holds; an attribute that is not (a new per-request dict, say) fails the test until it is
reviewed. Per-request state belongs in :class:`~connectors.vllm.requests.RequestState`.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.patches.engine import EngineFacts
from connectors.vllm.requests import RequestStates
from connectors.vllm.scheduler import Scheduler
from connectors.vllm.spec import ConnectorSpec
from lmcompact.store import TieredStore

FACTS = EngineFacts(
    model_id="probe",
    block_size=32,
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    dtype=torch.float32,
    prefix_caching=False,
    device_type="cpu",
)

REVIEWED = {
    # configuration, read-only after construction
    "spec": "the process's spec",
    "config": "the spec's options",
    "block_size": "engine block size",
    "tp_size": "tensor-parallel ranks",
    "slots": "slots per loaded chunk",
    "recompute_window": "sliding window a compacted load leaves to compute (0: none)",
    "save_wait_s": "wait for a chunk being saved",
    "policy": "the store policy (the spec's)",
    "capture": "whether packs capture window queries",
    "reserve_growth": "release option",
    "keyer": "chunk keys of prompts",
    "namespace_hex": "store namespace a kv_producer names and a kv_consumer checks",
    # collaborators
    "store": "rank 0's store",
    "rank_stores": "one store per rank",
    "planner": "release hole geometry; its holes live in the records",
    "ledger": "vLLM's block pool (patch)",
    "guard": "prefix-cache guard (patch); frontiers live in the records",
    # the one per-request record
    "states": "RequestStates: one RequestState per live request",
    # not per request
    "_scheduled": "ids scheduled in the step being planned (emptied every step)",
    "_step_rows": "the planned step's prefill tokens and rows, decode rows (reset every step)",
    "trace": "the step_trace file, or None",
    "_reported": "chunk slice keys the workers reported stored",
    "_saving": "chunk slice keys being saved -> when planned",
    "_version": "bumps when the known chunks change",
    "_next": "the next step's envelope (forgotten requests, H2O merges)",
    "stats": "store counters",
    "release_stats": "release counters",
}


def make_scheduler(extra: dict) -> Scheduler:
    spec = ConnectorSpec.from_parts(ConnectorConfig.from_extra(extra), FACTS, 4096)
    store = TieredStore(spec.namespaces[0], spec.config.store.store_config())
    return Scheduler(spec, [store])


@pytest.mark.parametrize(
    "extra",
    [
        {"policy": "snapkv", "budget": 0.5},
        {"policy": "snapkv", "budget": 0.5, "store": False, "release": {"prefill": "pack"}},
    ],
)
def test_every_scheduler_attribute_is_reviewed(extra: dict) -> None:
    scheduler = make_scheduler(extra)
    unknown = sorted(set(vars(scheduler)) - set(REVIEWED))
    assert not unknown, (
        f"new Scheduler attributes {unknown}: per-request state goes in RequestState"
    )
    assert isinstance(scheduler.states, RequestStates)
    assert scheduler.planner is None or scheduler.planner.holes is scheduler.states.holes


def test_the_spec_builds_the_policy_once() -> None:
    config = ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.5})
    spec = ConnectorSpec.from_parts(config, FACTS, 4096)
    assert spec.policy is config.policy_object  # parsing built it; the spec reuses it
    assert spec.store_policy is spec.policy
    whole = ConnectorSpec.from_parts(
        ConnectorConfig.from_extra({"policy": "none", "budget": 1.0}), FACTS, 4096
    )
    assert whole.store_policy.name == "none"
