"""KV layouts: RaggedKV (flat per (sequence, kv_head)) and helpers."""

from lmcompact.layout.ragged import RaggedKV, RaggedLayer, ragged_from_dense

__all__ = ["RaggedKV", "RaggedLayer", "ragged_from_dense"]
