"""Tiered store of compacted KV chunks: keys, codec, GPU/CPU/Redis tiers, eviction.

Engine-agnostic (torch, msgpack, numpy; redis-py only for the Redis tier). Typical use::

    ns = StoreNamespace("my-model", "bfloat16", "vllm-cpu", policy_name="snapkv",
                        policy_params={"budget": 0.5})
    keyer = ChunkKeyer(ns, chunk_size=256)
    store = TieredStore(ns, StoreConfig(cpu_capacity_bytes=8 << 30,
                                        redis_url="redis://127.0.0.1:6379/0"))
    keys = keyer.keys(token_ids)
    n_hit = store.lookup_prefix(keys)
    chunks = store.get_many(keys[:n_hit])
"""

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.codec import ChunkCodec, CorruptEntryError
from lmcompact.store.eviction import EvictionPolicy, FIFOPolicy, LRUPolicy, PinTable
from lmcompact.store.keys import (
    DEFAULT_CHUNK_SIZE,
    FORMAT_VERSION,
    ChunkKey,
    ChunkKeyer,
    StoreNamespace,
    chunk_keys,
)
from lmcompact.store.tiered import StoreConfig, TieredStore
from lmcompact.store.tiers import CPUTier, GPUTier, MemoryTier, StorageTier

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FORMAT_VERSION",
    "CPUTier",
    "ChunkCodec",
    "ChunkKey",
    "ChunkKeyer",
    "CompactedChunk",
    "CorruptEntryError",
    "EvictionPolicy",
    "FIFOPolicy",
    "GPUTier",
    "LRUPolicy",
    "MemoryTier",
    "PinTable",
    "StorageTier",
    "StoreConfig",
    "StoreNamespace",
    "TieredStore",
    "chunk_keys",
]
