"""Loaded per-head chunks as padded head rows (``lmcompact.compaction.per_head``), against a
plain loop over (layer, head) and chunk."""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.per_head import head_rows, layer_runs
from lmcompact.store import CompactedChunk

LAYERS, HEADS, D, CHUNK, SLOTS = 3, 2, 4, 16, 6


def _chunk(seed: int) -> CompactedChunk:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, SLOTS + 1, (LAYERS, HEADS), generator=gen, dtype=torch.int32)
    counts[0, 0] = SLOTS  # a full head and, somewhere, likely an empty one
    counts[2, 1] = 0
    total = int(counts.sum())
    positions = torch.cat(
        [torch.randperm(CHUNK, generator=gen)[: int(c)].sort().values for c in counts.flatten()]
    ).to(torch.int32)
    return CompactedChunk(
        keys=torch.randn(total, D, generator=gen),
        values=torch.randn(total, D, generator=gen),
        kept_counts=counts,
        positions=positions,
        num_tokens=CHUNK,
    )


def _loop(chunks: list[CompactedChunk]) -> tuple[torch.Tensor, torch.Tensor]:
    width = len(chunks) * SLOTS
    keys = torch.zeros(LAYERS, HEADS, width, D)
    counts = torch.zeros(LAYERS, HEADS, dtype=torch.int64)
    for chunk in chunks:
        for layer in range(LAYERS):
            for head in range(HEADS):
                k, _, _ = chunk.head(layer, head)
                n, at = k.shape[0], int(counts[layer, head])
                keys[layer, head, at : at + n] = k
                counts[layer, head] += n
    return keys, counts


@pytest.mark.parametrize("limit", [1, 10**9])  # one layer per run, or all at once
def test_head_rows_equal_a_plain_loop_in_any_run_of_layers(limit: int) -> None:
    chunks = [_chunk(seed) for seed in range(3)]
    want_keys, want_counts = _loop(chunks)
    runs = layer_runs(LAYERS, layer_bytes=100, limit=limit)
    assert runs == ([(0, 1), (1, 2), (2, 3)] if limit == 1 else [(0, 3)])
    got_keys, got_values, got_counts = [], [], []
    for lo, hi in runs:
        keys, values, counts = head_rows(chunks, lo, hi, SLOTS, torch.device("cpu"))
        got_keys.append(keys)
        got_values.append(values)
        got_counts.append(counts)
    assert torch.equal(torch.cat(got_keys), want_keys)
    assert torch.equal(torch.cat(got_counts), want_counts)
    # values follow the same rows as keys
    v = torch.cat(got_values)
    assert torch.equal(v[0, 0, :SLOTS], chunks[0].head(0, 0)[1])
    assert not v[2, 1].any()  # a head that kept nothing stays zeros


def test_a_chunk_over_the_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="over 5"):
        head_rows([_chunk(0)], 0, LAYERS, SLOTS - 1, torch.device("cpu"))
