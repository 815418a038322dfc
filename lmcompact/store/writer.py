"""Write-behind to a slow tier: a bounded queue drained by one background thread.

``submit`` blocks at most ``timeout_s`` when the queue is full (back-pressure), then drops the
write and counts it; the serving path never waits longer than that, and never sees a raise.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.codec import EncodedValue
from lmcompact.store.keys import ChunkKey
from lmcompact.store.tiers.base import StorageTier

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass
class WriterStats:
    queued: int = 0
    written: int = 0
    failed: int = 0
    dropped: int = 0


class AsyncWriter:
    """Drains ``(key, chunk)`` writes into ``tier`` in batches of up to ``batch_size``.

    Args:
        tier: the destination (typically a :class:`RedisTier`).
        max_queue: queue bound, in chunks.
        timeout_s: longest a full queue blocks ``submit`` before the write is dropped.
        batch_size: most chunks per ``put_many``.
    """

    def __init__(
        self, tier: StorageTier, max_queue: int = 64, timeout_s: float = 0.5, batch_size: int = 8
    ) -> None:
        self.tier = tier
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.stats = WriterStats()
        self._lock = threading.Lock()
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(
            target=self._run, name=f"lmc-{tier.name}-writer", daemon=True
        )
        self._closed = False
        self._thread.start()

    def submit(self, key: ChunkKey, chunk: CompactedChunk | EncodedValue) -> bool:
        """Queue a write (a chunk, or a value for a tier that :attr:`holds_encoded
        <lmcompact.store.tiers.base.StorageTier.holds_encoded>`); False when it was dropped
        (queue full past the timeout, or closed)."""
        if self._closed:
            return False
        try:
            self._queue.put((key, chunk), timeout=self.timeout_s)
        except queue.Full:
            with self._lock:
                self.stats.dropped += 1
            logger.debug("%s writer queue full: dropped a write", self.tier.name)
            return False
        with self._lock:
            self.stats.queued += 1
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write was attempted; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued writes (up to ``timeout_s``) and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s)
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def metrics(self) -> dict[str, int]:
        with self._lock:
            return {
                "queued": self.stats.queued,
                "written": self.stats.written,
                "failed": self.stats.failed,
                "dropped": self.stats.dropped,
                "pending": self._queue.qsize(),
            }

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                self._queue.task_done()
                return
            batch = [first]
            while len(batch) < self.batch_size:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._queue.put(_STOP)  # handled after this batch
                    self._queue.task_done()
                    break
                batch.append(item)
            try:
                ok = self.tier.put_many(batch)  # type: ignore[arg-type]
            except Exception:  # a tier must not raise; never let the thread die either
                logger.exception("%s writer: put_many raised", self.tier.name)
                ok = [False] * len(batch)
            with self._lock:
                self.stats.written += sum(ok)
                self.stats.failed += len(ok) - sum(ok)
            for _ in batch:
                self._queue.task_done()
