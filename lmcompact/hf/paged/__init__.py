"""Paged KV cache for transformers ``generate``: block pool, tables, beams, compaction, int8.

Importing this package imports transformers. Modules:

* ``blocks``      block ids with exact reference counts
* ``storage``     the pool's K/V tensors (float, or int8 + scales via ``quant``)
* ``table``       per-layer block tables, copy-on-write, beam reorder
* ``attention``   torch attention over a block table (shared-block decode path)
* ``compaction``  plan with a policy at the end of prefill, pack, free blocks
* ``step``        one decode step's host work for all layers, one upload (``DecodeState``)
* ``layer`` / ``cache``  the transformers ``Cache`` (``PagedCache``)
* ``graph``       CUDA graphs of a model's decode forward (``graphed_decode``)
"""

from lmcompact.hf.paged.blocks import BlockPool, BlockPoolExhausted
from lmcompact.hf.paged.cache import PagedCache, blocks_needed
from lmcompact.hf.paged.storage import KVStorage, StorageSpec
from lmcompact.hf.paged.table import BlockTable

__all__ = [
    "BlockPool",
    "BlockPoolExhausted",
    "BlockTable",
    "KVStorage",
    "PagedCache",
    "StorageSpec",
    "blocks_needed",
]
