"""GPU tier: compacted chunks held as device tensors, bounded by bytes."""

from __future__ import annotations

import torch

from lmcompact.store.eviction import EvictionPolicy
from lmcompact.store.tiers.memory import MemoryTier


class GPUTier(MemoryTier):
    """Device-memory tier; falls back to CPU tensors when CUDA is absent (tests, CPU hosts).

    Args:
        capacity_bytes: most payload bytes held on the device.
        device: target device; None picks ``"cuda"`` when available, else ``"cpu"``.
        eviction: eviction policy or its name.
    """

    def __init__(
        self,
        capacity_bytes: int,
        device: str | torch.device | None = None,
        *,
        eviction: str | EvictionPolicy = "lru",
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(capacity_bytes, device, eviction=eviction, name="gpu")
