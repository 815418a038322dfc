"""kv_producer / kv_consumer roles: options per role, the producer's entry, consumer waits.

The real-engine counterpart: ``tests/integration/store/test_pd_disaggregation.py`` (two
``vllm serve`` instances, Redis, ``examples/pd_proxy.py``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.disaggregation import (
    KV_CONSUMER,
    KV_PRODUCER,
    check_role,
    options_for_role,
    stored_params,
    stored_prefix,
)
from connectors.vllm.metadata import WorkerReport
from connectors.vllm.scheduler import REMOTE_POLL_S, Scheduler
from connectors.vllm.spec import ConnectorSpec
from tests.unit.vllm_connector import fakes

CHUNK = 64
REDIS = {"chunk_size": CHUNK, "tiers": ["cpu", "redis"], "redis_url": "redis://127.0.0.1:1/0"}


def test_a_consumer_never_saves_and_refuses_to_be_told_to() -> None:
    extra = {"policy": "snapkv", "budget": 0.5, "store": dict(REDIS)}
    assert options_for_role(extra, KV_CONSUMER)["store"]["save"] is False
    assert "save" not in extra["store"]  # the caller's options are not changed
    assert options_for_role(extra, KV_PRODUCER) == extra
    assert options_for_role({"budget": 0.5}, KV_CONSUMER)["store"] == {"save": False}
    with pytest.raises(ValueError, match="never saves"):
        options_for_role({"store": {**REDIS, "save": True}}, KV_CONSUMER)
    with pytest.raises(ValueError, match="kv_role must be one of"):
        options_for_role(extra, "kv_sender")


def test_roles_need_the_shared_redis_tier() -> None:
    local = ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.5})
    check_role(local, "kv_both")
    for role in (KV_PRODUCER, KV_CONSUMER):
        with pytest.raises(ValueError, match="Redis tier"):
            check_role(local, role)
    off = ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.5, "store": False})
    with pytest.raises(ValueError, match=r"store\.load"):
        check_role(off, KV_CONSUMER)
    shared = ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.5, "store": REDIS})
    check_role(shared, KV_PRODUCER)


def test_the_producers_entry_round_trips_and_bad_ones_are_refused() -> None:
    params = stored_params(512, "ab" * 16)
    parsed = stored_prefix(params)
    assert parsed is not None and (parsed.tokens, parsed.namespace) == (512, "ab" * 16)
    assert stored_prefix(None) is None and stored_prefix({"lmcompact": {"save": False}}) is None
    for bad in ({"tokens": -1, "namespace": "x"}, {"tokens": True, "namespace": "x"},
                {"tokens": 3}, "512"):  # fmt: skip
        with pytest.raises(ValueError, match="must be"):
            stored_prefix({"lmcompact": {"stored": bad}})


def consumer(**store: Any) -> Scheduler:
    extra = options_for_role(
        {"policy": "snapkv", "budget": 0.5, "store": {**REDIS, **store}}, KV_CONSUMER
    )
    built = ConnectorSpec.from_parts(
        ConnectorConfig.from_extra(extra), fakes.facts(), 4096, kv_role=KV_CONSUMER
    )
    return Scheduler(built, fakes.stores(built))


def test_a_consumer_waits_for_its_producers_chunks_then_loads_them() -> None:
    scheduler = consumer()
    prompt = list(range(3 * CHUNK + 5))
    params = stored_params(3 * CHUNK, scheduler.namespace_hex)
    req = fakes.request("r", prompt, params)
    assert scheduler.num_new_matched_tokens(req, 0) is None  # nothing in the store yet
    assert scheduler.num_new_matched_tokens(req, 0) is None  # asked again within the poll
    keys = scheduler.keyer.keys(prompt)
    scheduler.take_report(WorkerReport(saved=set(keys[:2])))
    time.sleep(2 * REMOTE_POLL_S)
    assert scheduler.num_new_matched_tokens(req, 0) is None  # 2 of 3 chunks
    scheduler.take_report(WorkerReport(saved={keys[2]}))
    time.sleep(2 * REMOTE_POLL_S)
    assert scheduler.num_new_matched_tokens(req, 0) == 3 * CHUNK
    assert scheduler.stats["remote_waits"] == 1 and scheduler.stats["remote_wait_timeouts"] == 0


def test_a_consumer_recomputes_when_the_chunks_never_come() -> None:
    scheduler = consumer(remote_wait_s=0.02)
    prompt = list(range(2 * CHUNK + 1))
    req = fakes.request("r", prompt, stored_params(2 * CHUNK, scheduler.namespace_hex))
    assert scheduler.num_new_matched_tokens(req, 0) is None
    time.sleep(0.05)
    assert scheduler.num_new_matched_tokens(req, 0) == 0  # recompute
    assert scheduler.stats["remote_wait_timeouts"] == 1
    assert scheduler.num_new_matched_tokens(req, 0) == 0  # no second wait


def test_a_foreign_namespace_is_not_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = consumer()
    req = fakes.request("r", list(range(2 * CHUNK + 1)), stored_params(2 * CHUNK, "0" * 32))
    assert scheduler.num_new_matched_tokens(req, 0) == 0
    assert scheduler.stats["remote_waits"] == 0
    assert "cannot load those chunks" in caplog.text
