"""Per-tier counters: hits, misses, bytes in and out, evictions, refused entries."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class TierMetrics:
    """Thread-safe counters of one tier. ``bytes_in`` counts stored bytes, ``bytes_out`` read.

    Attributes:
        hits: gets that found an entry.
        misses: gets that did not (including those answered while a tier is unhealthy).
        puts: entries stored.
        put_failures: puts that stored nothing (too large, all pinned, tier unhealthy).
        bytes_in: payload bytes stored.
        bytes_out: payload bytes returned by gets.
        evictions: entries evicted for capacity.
        rejected: stored values refused by the codec (corrupt, foreign, wrong version).
        errors: backend errors (connection lost, timeouts).
    """

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    rejected: int = 0
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Add ``deltas`` to the named counters, atomically."""
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
