"""Eviction policies for the in-memory tiers, and pin counts for entries being loaded.

A policy only orders keys; the tier owns the bytes. Policies are named in config:
``"lru"``, ``"fifo"`` or ``"package.module:ClassName"`` for a plugin.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator


class EvictionPolicy(ABC):
    """Orders a tier's keys for eviction. Not thread-safe: the tier holds its lock."""

    @abstractmethod
    def on_insert(self, key: Hashable, nbytes: int) -> None:
        """A new entry of ``nbytes`` was stored under ``key``."""

    @abstractmethod
    def on_access(self, key: Hashable) -> None:
        """``key`` was read (or re-put)."""

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """``key`` left the tier (deleted or evicted)."""

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Keys in eviction order, first to go first."""

    def victims(
        self, nbytes: int, sizes: Callable[[Hashable], int], skip: Callable[[Hashable], bool]
    ) -> list[Hashable] | None:
        """Keys to evict to free at least ``nbytes``, skipping keys for which ``skip`` holds.

        Returns:
            The victims, or None when even evicting every candidate would not free enough
            (then nothing should be evicted).
        """
        freed = 0
        out: list[Hashable] = []
        if nbytes <= 0:
            return out
        for key in self.candidates():
            if skip(key):
                continue
            out.append(key)
            freed += sizes(key)
            if freed >= nbytes:
                return out
        return None


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable, nbytes: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        return iter(list(self._order))


class FIFOPolicy(LRUPolicy):
    """First stored first; reads do not refresh an entry."""

    def on_access(self, key: Hashable) -> None:
        return None


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Build a policy from its config name (``"lru"``, ``"fifo"`` or ``"module:Class"``)."""
    if name in EVICTION_POLICIES:
        return EVICTION_POLICIES[name]()
    if ":" in name:
        module_name, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module_name), attr, None)
        if isinstance(cls, type) and issubclass(cls, EvictionPolicy):
            return cls()
        raise ValueError(f"eviction policy {name!r} is not an EvictionPolicy subclass")
    raise ValueError(
        f"unknown eviction policy {name!r}; allowed: {sorted(EVICTION_POLICIES)} or "
        "'package.module:ClassName'"
    )


class PinTable:
    """Pin counts of entries being loaded; a pinned entry is never evicted.

    Unpinning more often than pinning is a caller bug and raises instead of being clamped.
    """

    def __init__(self) -> None:
        self._counts: dict[Hashable, int] = {}

    def pin(self, key: Hashable) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def unpin(self, key: Hashable) -> None:
        count = self._counts.get(key, 0)
        if count <= 0:
            raise RuntimeError(f"unpin of {key!r} which is not pinned (pin count would be -1)")
        if count == 1:
            del self._counts[key]
        else:
            self._counts[key] = count - 1

    def is_pinned(self, key: Hashable) -> bool:
        return key in self._counts

    def count(self, key: Hashable) -> int:
        return self._counts.get(key, 0)

    def pinned_keys(self) -> list[Hashable]:
        return list(self._counts)
