"""Storage tiers: GPU and CPU memory (``MemoryTier``) and Redis (``RedisTier``, lazy)."""

from lmcompact.store.tiers.base import StorageTier
from lmcompact.store.tiers.cpu_tier import CPUTier
from lmcompact.store.tiers.gpu_tier import GPUTier
from lmcompact.store.tiers.memory import MemoryTier

__all__ = ["CPUTier", "GPUTier", "MemoryTier", "StorageTier"]
