"""In-memory tiers (device or host), with byte capacity, pluggable eviction and pinning.

Each entry lives in one uint8 buffer in the packed layout ``positions | keys | values``
(see :mod:`lmcompact.store.chunk`). Buffers of evicted entries are recycled for puts of
the same size, which is most puts (chunks of one model and budget share a size), so a put
is one copy into warm memory rather than a fresh allocation. A buffer is recycled only
when nothing outside the tier still views it (a caller holding a chunk from ``get``);
otherwise it is dropped and freed when that caller lets go.

A put that crosses host and CUDA (a device chunk into the pinned CPU tier, a host chunk into
the GPU tier) is queued on a side stream (:mod:`lmcompact.store.transfer`) and returns at
once; the entry keeps the copy's event, and ``get`` / ``peek`` wait on it before handing the
chunk out (a host entry: the thread waits; a device entry: the caller's stream waits).
Puts within one side copy synchronously, as they always did.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.eviction import EvictionPolicy, PinTable, make_eviction_policy
from lmcompact.store.keys import ChunkKey
from lmcompact.store.tiers.base import StorageTier
from lmcompact.store.transfer import CopierPool, PendingCopy

logger = logging.getLogger(__name__)

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _exclusive(buf: torch.Tensor, baseline: int) -> bool:
    """True when no tensor besides ``buf`` views its storage (so it may be overwritten)."""
    if _use_count is None:
        return False
    return int(_use_count(buf.untyped_storage()._cdata)) <= baseline


@dataclass
class _Entry:
    chunk: CompactedChunk
    buffer: torch.Tensor
    nbytes: int
    pending: PendingCopy | None = None

    def ready(self) -> CompactedChunk:
        """The chunk, once a pending copy into it may be read by the caller."""
        pending = self.pending
        if pending is not None:
            pending.wait()
            if pending.destination.type != "cuda" or pending.done():
                self.pending = None
        return self.chunk

    def settle(self) -> None:
        """Block until a pending copy finished (before the buffer is reused)."""
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None


class MemoryTier(StorageTier):
    """Chunks held as tensors on one device, bounded by ``capacity_bytes``.

    Args:
        capacity_bytes: most payload bytes held (live entries plus recycled buffers).
        device: where entries live (``"cuda:0"``, ``"cpu"``).
        pin_memory: allocate page-locked host buffers (CPU device with CUDA present).
        eviction: an :class:`EvictionPolicy` or its config name (default LRU).
        name: tier name for metrics and logs.
    """

    def __init__(
        self,
        capacity_bytes: int,
        device: str | torch.device = "cpu",
        *,
        pin_memory: bool = False,
        eviction: str | EvictionPolicy = "lru",
        name: str = "memory",
    ) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.name = name
        self.device = torch.device(device)
        if pin_memory and self.device.type != "cpu":
            raise ValueError(f"pin_memory needs a CPU device, got {self.device}")
        self.pin_memory = pin_memory
        self._capacity = capacity_bytes
        self._policy = make_eviction_policy(eviction) if isinstance(eviction, str) else eviction
        self._pins = PinTable()
        self._entries: dict[ChunkKey, _Entry] = {}
        self._free: dict[int, list[torch.Tensor]] = {}
        self._allocated = 0
        self._used = 0
        self._baseline_uses = 0
        self._copiers = CopierPool()
        self._inflight: set[ChunkKey] = set()  # entries whose copy may still run
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[ChunkKey]:
        """Stored keys in eviction order (first to go first)."""
        with self._lock:
            return [k for k in self._policy.candidates() if isinstance(k, ChunkKey)]

    # -- StorageTier ----------------------------------------------------------------------
    def get(self, key: ChunkKey) -> CompactedChunk | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._policy.on_access(key)
        if entry is None:
            self.stats.add(misses=1)
            return None
        self.stats.add(hits=1, bytes_out=entry.nbytes)
        return entry.ready()

    def peek(self, key: ChunkKey) -> CompactedChunk | None:
        """The stored chunk without counting a hit or refreshing its eviction order."""
        entry = self._entries.get(key)
        return None if entry is None else entry.ready()

    def contains(self, key: ChunkKey) -> bool:
        return key in self._entries

    def put(self, key: ChunkKey, chunk: CompactedChunk) -> bool:
        return self.put_many([(key, chunk)])[0]

    def put_many(self, items: Sequence[tuple[ChunkKey, CompactedChunk]]) -> list[bool]:
        """Puts of a batch; copies that cross host and CUDA share one side-stream hand-off
        and one event (a batch of small chunks is bound by per-copy costs otherwise)."""
        if len({chunk.device for _, chunk in items}) > 1:  # one copy path per batch
            return [self.put_many([item])[0] for item in items]
        ok = [False] * len(items)
        todo: list[tuple[int, ChunkKey, CompactedChunk, torch.Tensor]] = []
        with self._lock:
            seen: set[ChunkKey] = set()
            for i, (key, chunk) in enumerate(items):
                if key in self._entries or key in seen:
                    if key in self._entries:
                        self._policy.on_access(key)
                    ok[i] = True
                    continue
                nbytes = chunk.payload_nbytes
                buf = self._reserve(nbytes)
                if buf is None:
                    self.stats.add(put_failures=1)
                    logger.debug(
                        "%s tier: no room for %d bytes (capacity %d)",
                        self.name,
                        nbytes,
                        self._capacity,
                    )
                    continue
                self._used += nbytes
                seen.add(key)
                todo.append((i, key, chunk, buf))
        if not todo:
            return ok
        try:
            stored, pending = self._copy_in([t[2] for t in todo], [t[3] for t in todo])
        except BaseException:
            with self._lock:
                for _, _, chunk, buf in todo:
                    self._used -= chunk.payload_nbytes
                    self._free.setdefault(chunk.payload_nbytes, []).append(buf)
            raise
        inserted = 0
        with self._lock:
            for (i, key, chunk, buf), kept in zip(todo, stored, strict=True):
                nbytes = chunk.payload_nbytes
                if key in self._entries:  # a concurrent put of the same content won
                    if pending is not None:
                        pending.synchronize()
                    self._used -= nbytes
                    self._free.setdefault(nbytes, []).append(buf)
                else:
                    self._entries[key] = _Entry(kept, buf, nbytes, pending)
                    if pending is not None:
                        self._inflight.add(key)
                    self._policy.on_insert(key, nbytes)
                    inserted += nbytes
                    self.stats.add(puts=1)
                ok[i] = True
            self._release_finished()
        self.stats.add(bytes_in=inserted)
        return ok

    def _copy_in(
        self, chunks: list[CompactedChunk], buffers: list[torch.Tensor]
    ) -> tuple[list[CompactedChunk], PendingCopy | None]:
        """Copy ``chunks`` into this tier's ``buffers``: on a side stream when the copy
        crosses host and CUDA (pending until its event), else at once."""
        copier = self._copiers.for_copy(chunks[0].device, self.device)
        if copier is None:
            return [c.pack_into(b) for c, b in zip(chunks, buffers, strict=True)], None
        return copier.pack_many(chunks, buffers)

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self._entries or self._pins.is_pinned(key):
                return False
            self._remove(key)
            return True

    def pin(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self._entries:
                return False
            self._pins.pin(key)
            return True

    def unpin(self, key: ChunkKey) -> None:
        with self._lock:
            self._pins.unpin(key)

    def pin_count(self, key: ChunkKey) -> int:
        with self._lock:
            return self._pins.count(key)

    def metrics(self) -> dict[str, object]:
        out = super().metrics()
        out["entries"] = len(self._entries)
        out["allocated_bytes"] = self._allocated
        out["device"] = str(self.device)
        return out

    def clear(self) -> None:
        """Drop every unpinned entry and all recycled buffers."""
        with self._lock:
            for key in [k for k in self._entries if not self._pins.is_pinned(k)]:
                self._remove(key)
            self._allocated -= sum(n * len(b) for n, b in self._free.items())
            self._free.clear()

    # -- internals (lock held) --------------------------------------------------------------
    def _remove(self, key: ChunkKey) -> _Entry:
        entry = self._entries.pop(key)
        self._inflight.discard(key)
        entry.settle()  # a copy still writing into the buffer must end before its reuse
        self._policy.on_remove(key)
        self._used -= entry.nbytes
        self._free.setdefault(entry.nbytes, []).append(entry.buffer)
        return entry

    def _release_finished(self) -> None:
        """Forget copies that finished, releasing the sources they kept alive."""
        for key in list(self._inflight):
            entry = self._entries.get(key)
            if entry is None or entry.pending is None or entry.pending.done():
                self._inflight.discard(key)
                if entry is not None:
                    entry.pending = None

    def _take_free(self, nbytes: int) -> torch.Tensor | None:
        bufs = self._free.get(nbytes)
        while bufs:
            buf = bufs.pop()
            if _exclusive(buf, self._baseline_uses):
                return buf
            self._allocated -= nbytes  # still viewed by a caller: let it go with them
        return None

    def _drop_one_free(self) -> bool:
        for size, bufs in self._free.items():
            if bufs:
                bufs.pop()
                self._allocated -= size
                return True
        return False

    def _allocate(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory)
        if not self._baseline_uses and _use_count is not None:
            self._baseline_uses = int(_use_count(buf.untyped_storage()._cdata))
        self._allocated += nbytes
        return buf

    def _reserve(self, nbytes: int) -> torch.Tensor | None:
        if nbytes > self._capacity:
            return None
        pinned = sum(
            self._entries[k].nbytes for k in self._pins.pinned_keys() if k in self._entries
        )
        if pinned + nbytes > self._capacity:
            return None
        while True:
            buf = self._take_free(nbytes)
            if buf is not None:
                return buf
            if self._allocated + nbytes <= self._capacity:
                return self._allocate(nbytes)
            if self._drop_one_free():
                continue
            victim = next(
                (k for k in self._policy.candidates() if not self._pins.is_pinned(k)), None
            )
            if victim is None:
                return None
            self._remove(victim)  # type: ignore[arg-type]
            self.stats.add(evictions=1)
