"""Quantized CPU tier: a quantizing store's host memory holds the codec's values.

A memory tier (:mod:`lmcompact.store.tiers.memory`) holds chunks in the engine dtype, so a
quantizing store (``StoreConfig.quantize``) would save bytes only in Redis. This tier holds
the codec's value itself (int8 or fp8 rows with float16 scales, about half of bf16), so the
host memory a stored prefix takes is what the quantization promises; a get decodes the
value (checksum, namespace and format checks, then dequantization into a fresh chunk, on
the device the caller names: a loading GPU worker gets the int8 bytes dequantized on its
GPU, not a host pass over every row).

Values are immutable ``bytes``. A many-chunk get verifies their checksums on a few threads
(xxHash releases the GIL) while the caller copies and dequantizes the ones already
verified, in order, on its own stream; what was verified is what is decoded. Bound for a
GPU, those threads also copy each verified payload into a slot of a page-locked ring
(:mod:`lmcompact.store.tiers.staging`) and the caller copies the slot to the GPU
asynchronously: values stay pageable at rest (a page-locked allocation per saved value
costs more than it saves: ``docs/benchmarks/connector-default-h200.md``). Eviction is least recently
used, entries being loaded are pinned (:meth:`pin`), and a value the codec refuses is
dropped and counted as ``rejected``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.codec import ChunkCodec, CorruptEntryError, EncodedValue
from lmcompact.store.eviction import PinTable
from lmcompact.store.keys import ChunkKey
from lmcompact.store.pinned_pool import size_class
from lmcompact.store.tiers.base import StorageTier
from lmcompact.store.tiers.staging import RingClosed, StagingRing

logger = logging.getLogger(__name__)

PARALLEL_VERIFY_BYTES = 1 << 22
"""A get verifies on worker threads once its values hold this many bytes (below, the
threads' hand-off costs more than it saves)."""

MAX_SLOT_BYTES = 64 << 20
"""Largest value a get stages through the page-locked ring (larger ones copy directly)."""


class EncodedCPUTier(StorageTier):
    """Host-memory tier of encoded (quantized) values.

    Args:
        capacity_bytes: most value bytes held.
        codec: the store's codec (its namespace and quantization).
    """

    name = "cpu"
    holds_encoded = True

    def __init__(self, capacity_bytes: int, codec: ChunkCodec) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.codec = codec
        self._capacity = capacity_bytes
        self._values: OrderedDict[ChunkKey, bytes] = OrderedDict()  # oldest use first
        self._verifier: ThreadPoolExecutor | None = None
        self._workers = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._ring: StagingRing | None = None
        self._pins = PinTable()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: ChunkKey) -> CompactedChunk | None:
        return self.get_many([key])[0]

    def put(self, key: ChunkKey, chunk: CompactedChunk) -> bool:
        return self.put_many([(key, chunk)])[0]

    def contains(self, key: ChunkKey) -> bool:
        return key in self._values

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._drop(key)

    def get_many(
        self, keys: Sequence[ChunkKey], device: torch.device | str | None = None
    ) -> list[CompactedChunk | None]:
        """Decoded chunks (None where missing or refused), dequantized on ``device`` (None:
        on the host)."""
        with self._lock:
            found = []
            for key in keys:
                value = self._values.get(key)
                if value is not None:
                    self._values.move_to_end(key)
                found.append(value)
        ring = self._claim_ring(found, device)
        checks = self._verify_ahead(found, ring)
        out: list[CompactedChunk | None] = []
        hits = nbytes = rejected = 0
        try:
            for index, (key, value, check) in enumerate(zip(keys, found, checks, strict=True)):
                chunk = None
                done: torch.cuda.Event | None = None
                if value is not None:
                    try:
                        staged = None
                        if check is not None:
                            slot = check.result()
                            if slot is not None:
                                staged = slot.to(device, non_blocking=True)
                                done = torch.cuda.Event()
                                done.record(torch.cuda.current_stream(staged.device))
                        chunk = self.codec.decode(
                            value, device, checked=check is not None, staged=staged
                        )
                    except CorruptEntryError as exc:
                        logger.warning("cpu tier refused %r: %s", key, exc)
                        rejected += 1
                        self.delete(key)
                if ring is not None:
                    ring.issued(index, done)
                out.append(chunk)
                if chunk is not None:
                    hits += 1
                    nbytes += len(value or b"")
        finally:
            if ring is not None:
                ring.close()
                for check in checks:
                    if check is not None:
                        check.exception()  # wait: no worker may still write a slot
                ring.release()
        self.stats.add(hits=hits, misses=len(keys) - hits, bytes_out=nbytes, rejected=rejected)
        return out

    def reserve_staging(self, value_bytes: int) -> int:
        """Allocate the page-locked ring for values of up to ``value_bytes`` now (at
        start-up) rather than in the first get that needs it; returns its bytes (0 when
        such values are too large to stage)."""
        if value_bytes > MAX_SLOT_BYTES:
            return 0
        ring = self._ring
        if ring is None or ring.slot_bytes < value_bytes:
            ring = self._new_ring(value_bytes)
        return ring.slots * ring.slot_bytes

    def _new_ring(self, value_bytes: int) -> StagingRing:
        """A ring for values of up to ``value_bytes``, two slots per verifying thread, in
        place of the tier's current one."""
        self._ring = StagingRing(size_class(value_bytes), 2 * self._workers)
        return self._ring

    def _claim_ring(
        self, found: Sequence[bytes | None], device: torch.device | str | None
    ) -> StagingRing | None:
        """The page-locked ring for a get bound for a GPU that verifies on threads (None:
        not such a get, values too large, or another get holds the ring)."""
        if device is None or torch.device(device).type != "cuda" or not self._threaded(found):
            return None
        largest = max(len(v) for v in found if v is not None)
        if largest > MAX_SLOT_BYTES:
            return None
        ring = self._ring
        if ring is None or ring.slot_bytes < largest:
            if ring is not None and not ring.begin():
                return None  # in use: this get copies directly
            ring = self._new_ring(largest)
        return ring if ring.begin() else None

    def _threaded(self, found: Sequence[bytes | None]) -> bool:
        values = [v for v in found if v is not None]
        return len(values) >= 2 and sum(len(v) for v in values) >= PARALLEL_VERIFY_BYTES

    def _verify_ahead(
        self, found: Sequence[bytes | None], ring: StagingRing | None
    ) -> list[Future[torch.Tensor | None] | None]:
        """Checksums of several large values started on worker threads, each also staged
        in ``ring`` when given (None each: the decode verifies inline)."""
        if not self._threaded(found):
            return [None] * len(found)
        if self._verifier is None:
            self._verifier = ThreadPoolExecutor(self._workers, thread_name_prefix="lmc-verify")
        pool = self._verifier
        return [
            None if v is None else pool.submit(self._verify_and_stage, v, i, ring)
            for i, v in enumerate(found)
        ]

    def _verify_and_stage(
        self, value: bytes, index: int, ring: StagingRing | None
    ) -> torch.Tensor | None:
        """Worker thread: verify ``value``; with a ring, copy its quantized payload into
        chunk ``index``'s slot and return the slot's view."""
        span = self.codec.verify(value)
        if ring is None or span is None or not span[1] or span[1] > ring.slot_bytes:
            return None
        try:
            return ring.stage(
                index, torch.frombuffer(value, dtype=torch.uint8, count=span[1], offset=span[0])
            )
        except RingClosed:
            return None

    def put_many(
        self, items: Sequence[tuple[ChunkKey, CompactedChunk | EncodedValue]]
    ) -> list[bool]:
        """Store chunks (encoded here) or values the store's codec encoded already."""
        out = []
        for key, item in items:
            value = item if isinstance(item, EncodedValue) else self.codec.encode(item)
            out.append(self._put_value(key, value.tobytes()))
        return out

    def _put_value(self, key: ChunkKey, data: bytes) -> bool:
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return True
            if len(data) > self._capacity:
                self.stats.add(put_failures=1)
                return False
            while self._used + len(data) > self._capacity:
                victim = next((k for k in self._values if not self._pins.is_pinned(k)), None)
                if victim is None:  # everything left is being loaded
                    self.stats.add(put_failures=1)
                    return False
                self._drop(victim)
                self.stats.add(evictions=1)
            self._values[key] = data
            self._used += len(data)
        self.stats.add(puts=1, bytes_in=len(data))
        return True

    def _drop(self, key: ChunkKey) -> bool:
        data = self._values.pop(key, None)
        if data is None:
            return False
        self._used -= len(data)
        return True

    def pin(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self._values:
                return False
            self._pins.pin(key)
            return True

    def unpin(self, key: ChunkKey) -> None:
        with self._lock:
            self._pins.unpin(key)
