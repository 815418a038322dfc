"""The connector's counters in vLLM's connector stats, its log and its Prometheus ``/metrics``.

vLLM asks both connector halves for stats every step (``get_kv_connector_stats``: the
worker's ride to the scheduler process on the model runner output, where the scheduler's
are added), sends them with its scheduler stats to the API server, and hands them to the
connector's :class:`LMCompactPromMetrics` (``build_prom_metrics``) and to its periodic
"KV Transfer metrics" log line. The payload is a flat ``{counter: increase}`` dict (it
crosses processes as msgpack), the increases since that half's last report::

    worker half     {"stored_chunks": 4, "stored_bytes": 9.4e6, "stored_full_bytes": 1.9e7}
    scheduler half  {"store_lookups": 1, "store_misses": 1}
    summed          -> vllm:lmcompact_stored_chunks_total{engine="0",model_name=...} += 4

Only counters (monotonic); with tensor parallelism the worker counters of every rank add up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

PREFIX = "vllm:lmcompact_"
"""Prometheus name prefix (vLLM's ``vllm:`` namespace; the client appends ``_total``)."""

COUNTERS: dict[str, str] = {
    # scheduler half
    "store_lookups": "Store lookups of a request's chunk-aligned prefix (vLLM may ask again "
    "for a request it could not admit yet)",
    "store_hits": "Store lookups that found at least the prefix's first chunk",
    "store_misses": "Store lookups that found no chunk of the prefix",
    "store_hit_chunks": "Stored chunks scheduled for loading into requests",
    "blocks_released": "KV blocks given back to vLLM's pool by compaction holes",
    "holes_adopted": "Compacted store loads whose hole blocks the release group gave back",
    "admissions_deferred": "Admissions deferred to keep room for running requests' growth",
    "remote_waits": "kv_consumer requests that waited for chunks their producer stored",
    "remote_wait_timeouts": "kv_consumer requests whose producer's chunks never arrived in "
    "store.remote_wait_s (the rest recomputed)",
    # worker half
    "packs": "Prompts packed in place (release group)",
    "packed_tokens": "Prompt tokens the in-place packs compacted",
    "stored_chunks": "Chunks written to the store",
    "stored_bytes": "Bytes of K/V the stored chunks hold",
    "stored_full_bytes": "Bytes of K/V the stored chunks would hold uncompacted",
    "loaded_chunks": "Stored chunks written into requests' KV blocks",
    "loaded_bytes": "Bytes the loaded chunks take in the store (what a load moves)",
    "load_failures": "Loads that could not be written (missing or bad chunks: recomputed)",
    "rejected_chunks": "Stored chunks refused as damaged or of another shape",
    "saves_skipped": "Saves skipped because page copies waiting for compaction were full",
    "save_errors": "Saves that failed (their prompts are recomputed when repeated)",
}
"""Counter name -> its Prometheus help text; the payload's keys are these names."""

SCHEDULER_SOURCES: dict[str, tuple[str, str]] = {
    "store_lookups": ("stats", "lookups"),
    "store_hits": ("stats", "hits"),
    "store_misses": ("stats", "misses"),
    "store_hit_chunks": ("stats", "hit_chunks"),
    "remote_waits": ("stats", "remote_waits"),
    "remote_wait_timeouts": ("stats", "remote_wait_timeouts"),
    "blocks_released": ("release_stats", "blocks_released"),
    "holes_adopted": ("release_stats", "holes_adopted"),
    "admissions_deferred": ("release_stats", "admissions_deferred"),
}
WORKER_SOURCES: dict[str, tuple[str, str]] = {
    "packs": ("pack_stats", "packs"),
    "packed_tokens": ("pack_stats", "tokens"),
    "stored_chunks": ("stats", "saved_chunks"),
    "stored_bytes": ("stats", "bytes_stored"),
    "stored_full_bytes": ("stats", "bytes_full"),
    "loaded_chunks": ("stats", "loaded_chunks"),
    "loaded_bytes": ("stats", "loaded_bytes"),
    "load_failures": ("stats", "load_failures"),
    "rejected_chunks": ("stats", "rejected_chunks"),
    "saves_skipped": ("stats", "saves_skipped"),
    "save_errors": ("stats", "save_errors"),
}
"""Counter -> (attribute of the half, key or field in it) where the half keeps its total."""


def read_counters(half: Any, sources: Mapping[str, tuple[str, str]]) -> dict[str, float]:
    """The half's running totals of ``sources``' counters (a dict or a dataclass each)."""
    totals: dict[str, float] = {}
    for name, (attribute, key) in sources.items():
        holder = getattr(half, attribute)
        value = holder.get(key, 0) if isinstance(holder, dict) else getattr(holder, key)
        totals[name] = float(value)
    return totals


class CounterDeltas:
    """Turns running totals into the increases since the previous call."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, totals: Mapping[str, float]) -> dict[str, float]:
        increases = {}
        for name, total in totals.items():
            grown = total - self._last.get(name, 0.0)
            if grown > 0:
                increases[name] = grown
            self._last[name] = total
        return increases


@dataclass
class LMCompactStats(KVConnectorStats):  # type: ignore[misc]
    """vLLM's connector stats: ``data`` is ``{counter name: increase}``."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> LMCompactStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0.0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class LMCompactPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """One Prometheus counter per :data:`COUNTERS` entry, labelled per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {
            name: self._counter_cls(
                name=f"{PREFIX}{name}", documentation=text, labelnames=self._labelnames
            )
            for name, text in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is None:
                raise ValueError(f"unknown lmcompact counter {name!r}; known: {sorted(COUNTERS)}")
            counter.labels(*labels).inc(value)
