"""``StorageTier``: the small interface every tier implements, with default batched loops."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.keys import ChunkKey
from lmcompact.store.metrics import TierMetrics


class StorageTier(ABC):
    """One level of the store. Operations never raise for backend faults: a failing backend
    answers misses (``get`` -> None, ``put`` -> False) and counts them.

    Chunks returned by ``get`` may be views of what the tier holds: callers must not write
    into them (copy out instead), and should :meth:`pin` entries they are loading.
    """

    name: str = "tier"
    holds_encoded: bool = False
    """True for a tier that holds the store codec's values (Redis): its ``put_many`` also
    takes :class:`lmcompact.store.codec.EncodedValue` items, so a quantizing store hands it
    the value it quantized once. Memory tiers hold chunks (tensors in the engine dtype)."""

    def __init__(self) -> None:
        self.stats = TierMetrics()

    @property
    def capacity_bytes(self) -> int | None:
        """Byte capacity, or None when the backend manages its own (Redis)."""
        return None

    @property
    def used_bytes(self) -> int:
        return 0

    @abstractmethod
    def get(self, key: ChunkKey) -> CompactedChunk | None:
        """The chunk stored under ``key``, or None."""

    @abstractmethod
    def put(self, key: ChunkKey, chunk: CompactedChunk) -> bool:
        """Store ``chunk``; True when it is (now or already) stored."""

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether ``key`` is stored (no hit/miss counted)."""

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Remove ``key``; True when something was removed."""

    def get_many(self, keys: Sequence[ChunkKey]) -> list[CompactedChunk | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: Sequence[tuple[ChunkKey, CompactedChunk]]) -> list[bool]:
        return [self.put(k, c) for k, c in items]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def pin(self, key: ChunkKey) -> bool:
        """Protect ``key`` from eviction while it is loaded; False when not pinned here
        (not stored, or a tier that does not evict by itself)."""
        return False

    def unpin(self, key: ChunkKey) -> None:
        """Undo one successful :meth:`pin`; an unmatched unpin raises RuntimeError."""
        raise RuntimeError(f"{self.name} tier: unpin of {key!r} which was never pinned")

    @property
    def healthy(self) -> bool:
        return True

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.stats.snapshot())
        out["used_bytes"] = self.used_bytes
        out["capacity_bytes"] = self.capacity_bytes
        out["healthy"] = self.healthy
        return out

    def close(self) -> None:
        """Release resources (threads, connections)."""
        return None
