"""Connector stats: increases per report, summed across halves, into Prometheus counters."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connectors.vllm import stats
from connectors.vllm.connector import LMCompactConnector
from connectors.vllm.stats import CounterDeltas, LMCompactPromMetrics, LMCompactStats


@dataclass
class _Release:
    blocks_released: int = 0
    holes_adopted: int = 0
    admissions_deferred: int = 0


class _SchedulerHalf:
    def __init__(self) -> None:
        self.stats = {"lookups": 3, "hits": 1, "misses": 2, "hit_chunks": 4}
        self.release_stats = _Release(blocks_released=6)


def test_every_counter_has_a_source_and_help() -> None:
    sources = {**stats.SCHEDULER_SOURCES, **stats.WORKER_SOURCES}
    assert set(sources) == set(stats.COUNTERS)
    assert all(text.strip() for text in stats.COUNTERS.values())


def test_deltas_report_increases_once() -> None:
    half = _SchedulerHalf()
    deltas = CounterDeltas()
    first = deltas.take(stats.read_counters(half, stats.SCHEDULER_SOURCES))
    assert first == {
        "store_lookups": 3.0,
        "store_hits": 1.0,
        "store_misses": 2.0,
        "store_hit_chunks": 4.0,
        "blocks_released": 6.0,
    }
    assert deltas.take(stats.read_counters(half, stats.SCHEDULER_SOURCES)) == {}
    half.stats["misses"] += 1
    half.release_stats.blocks_released += 2
    again = deltas.take(stats.read_counters(half, stats.SCHEDULER_SOURCES))
    assert again == {"store_misses": 1.0, "blocks_released": 2.0}


def test_stats_aggregate_and_survive_the_wire() -> None:
    worker = LMCompactConnector.build_kv_connector_stats({"stored_chunks": 2.0, "packs": 1.0})
    other = LMCompactStats(data={"stored_chunks": 1.0, "store_hits": 1.0})
    summed = worker.aggregate(other)
    assert summed.reduce() == {"stored_chunks": 3.0, "packs": 1.0, "store_hits": 1.0}
    rebuilt = LMCompactConnector.build_kv_connector_stats(summed.to_dict())
    assert rebuilt.data == summed.data and not rebuilt.is_empty()
    assert LMCompactConnector.build_kv_connector_stats(None).is_empty()


def test_prometheus_counters_per_engine() -> None:
    registry = CollectorRegistry()

    def bound(kind: type) -> type:
        class Bound(kind):  # type: ignore[misc, valid-type]
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    labels = {0: ["m", "0"], 1: ["m", "1"]}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = LMCompactConnector.build_prom_metrics(config, types, ["model_name", "engine"], labels)
    assert isinstance(prom, LMCompactPromMetrics)
    prom.observe({"stored_chunks": 2.0}, 0)
    prom.observe({"stored_chunks": 3.0, "store_misses": 1.0}, 0)
    prom.observe({"stored_chunks": 5.0}, 1)

    def value(name: str, engine: str) -> float | None:
        labels = {"model_name": "m", "engine": engine}
        return registry.get_sample_value(f"vllm:lmcompact_{name}_total", labels)

    assert value("stored_chunks", "0") == 5.0
    assert value("stored_chunks", "1") == 5.0
    assert value("store_misses", "0") == 1.0
    with pytest.raises(ValueError, match="unknown lmcompact counter"):
        prom.observe({"bogus": 1.0}, 0)
