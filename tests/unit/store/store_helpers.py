"""Chunk builders and comparisons shared by the store tests."""

from __future__ import annotations

import torch

from lmcompact.store import CompactedChunk, StoreNamespace


def make_namespace(**changes: object) -> StoreNamespace:
    fields: dict[str, object] = {
        "model_id": "test-model",
        "kv_dtype": "bfloat16",
        "kv_layout": "test",
    }
    fields.update(changes)
    return StoreNamespace(**fields)  # type: ignore[arg-type]


def make_chunk(
    seed: int,
    layers: int = 2,
    heads: int = 3,
    kept: int = 8,
    dim: int = 16,
    dtype: torch.dtype = torch.float32,
) -> CompactedChunk:
    """A uniform chunk whose contents are a function of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, heads, kept, dim, generator=g).to(dtype)
    v = torch.randn(layers, heads, kept, dim, generator=g).to(dtype)
    return CompactedChunk.from_dense(k, v, torch.arange(kept) * 2, num_tokens=2 * kept)


def same_chunk(a: CompactedChunk, b: CompactedChunk) -> bool:
    return (
        a.num_tokens == b.num_tokens
        and torch.equal(a.kept_counts, b.kept_counts)
        and torch.equal(a.positions.cpu(), b.positions.cpu())
        and torch.equal(a.keys.cpu().view(torch.uint8), b.keys.cpu().view(torch.uint8))
        and torch.equal(a.values.cpu().view(torch.uint8), b.values.cpu().view(torch.uint8))
    )
