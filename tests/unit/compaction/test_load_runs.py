"""Loaded chunks (``lmcompact.compaction.chunks.runs_of_bytes``) are gathered in runs of bounded
bytes and written once per layer per run."""

from __future__ import annotations

import torch

from lmcompact.compaction.chunks import runs_of_bytes
from lmcompact.store import CompactedChunk


def chunk(kept_rows: int, head_dim: int = 4) -> CompactedChunk:
    return CompactedChunk(
        keys=torch.zeros(kept_rows, head_dim),
        values=torch.zeros(kept_rows, head_dim),
        kept_counts=torch.tensor([[kept_rows]], dtype=torch.int32),
        positions=torch.arange(kept_rows, dtype=torch.int32),
        num_tokens=kept_rows * 2,
    )


def test_runs_keep_order_and_respect_the_byte_limit() -> None:
    chunks = [chunk(8) for _ in range(5)]  # 8 rows x 4 x 4 bytes x 2 = 256 bytes each
    runs = runs_of_bytes(chunks, limit=600)
    assert [first for first, _ in runs] == [0, 2, 4]
    assert [len(run) for _, run in runs] == [2, 2, 1]
    assert [c for _, run in runs for c in run] == chunks  # every chunk once, in order


def test_a_chunk_larger_than_the_limit_is_a_run_of_its_own() -> None:
    chunks = [chunk(8), chunk(64), chunk(8)]
    runs = runs_of_bytes(chunks, limit=300)
    assert [(first, len(run)) for first, run in runs] == [(0, 1), (1, 1), (2, 1)]


def test_everything_in_one_run_under_a_large_limit() -> None:
    chunks = [chunk(8) for _ in range(3)]
    assert [(first, len(run)) for first, run in runs_of_bytes(chunks, limit=1 << 20)] == [(0, 3)]
