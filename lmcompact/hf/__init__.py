"""transformers integration: model preparation, a compacting ``Cache``, attention hooks.

``lmcompact.hf.prepare`` imports transformers only when it converts a model, so
``from lmcompact.hf.prepare import prepare_model`` is cheap (vLLM users call it).
The cache and attention modules import transformers at module import time.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """Import heavy classes on first use, so ``lmcompact.hf.prepare`` stays cheap."""
    if name == "PagedCache":
        from lmcompact.hf.paged import PagedCache

        return PagedCache
    if name == "CompactingCache":
        from lmcompact.hf.cache import CompactingCache

        return CompactingCache
    raise AttributeError(f"module 'lmcompact.hf' has no attribute {name!r}")
