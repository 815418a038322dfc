"""CPU tier: compacted chunks in host memory (page-locked when CUDA is present), LRU."""

from __future__ import annotations

import torch

from lmcompact.store.eviction import EvictionPolicy
from lmcompact.store.tiers.memory import MemoryTier


class CPUTier(MemoryTier):
    """Host-memory tier.

    Args:
        capacity_bytes: most payload bytes held.
        pin_memory: page-locked buffers for fast async copies to the GPU; None means
            "when CUDA is available".
        eviction: eviction policy or its name.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        pin_memory: bool | None = None,
        eviction: str | EvictionPolicy = "lru",
    ) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        super().__init__(
            capacity_bytes, "cpu", pin_memory=pin_memory, eviction=eviction, name="cpu"
        )
