"""Loaded per-head chunks as dense cells (``lmcompact.compaction.per_head.cell_images``),
against a plain loop over chunk, layer and head whose rows :func:`dense_image` lays out, and
``Worker._write_per_head`` (its only caller) against the same loop written page by page."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lmcompact.compaction.page_layout import make_layout
from lmcompact.compaction.per_head import cell_images, dense_image, dense_rows, layer_runs
from lmcompact.compaction.per_head_attention import PerHeadAttention
from lmcompact.store import CompactedChunk

LAYERS, HEADS, D, CHUNK, BS = 3, 2, 4, 16, 2
CAP, SLOTS = 6, 4  # a head keeps at most CAP rows of a chunk, a layer SLOTS x HEADS cells


def _chunk(seed: int) -> CompactedChunk:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, CAP + 1, (LAYERS, HEADS), generator=gen, dtype=torch.int32)
    counts[0] = torch.tensor([CAP, SLOTS * HEADS - CAP])  # a full head; layer 0's cells full
    counts[2, 1] = 0  # an empty head
    counts[1, 0] = min(int(counts[1, 0]), SLOTS * HEADS - int(counts[1, 1]))
    counts[2, 0] = min(int(counts[2, 0]), SLOTS * HEADS)
    total = int(counts.sum())
    positions = torch.cat(
        [torch.randperm(CHUNK, generator=gen)[: int(c)].sort().values for c in counts.flatten()]
    ).to(torch.int32)
    return CompactedChunk(
        keys=torch.randn(total, D, generator=gen).to(torch.bfloat16),
        values=torch.randn(total, D, generator=gen).to(torch.bfloat16),
        kept_counts=counts,
        positions=positions,
        num_tokens=CHUNK,
    )


def _loop(chunks: list[CompactedChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (layer, head) its rows of every chunk, laid out by ``dense_image`` layer by layer."""
    n = len(chunks) * CAP
    rows = torch.zeros(2, LAYERS, HEADS, n, D, dtype=torch.bfloat16)
    counts = torch.zeros(LAYERS, HEADS, dtype=torch.int64)
    for chunk in chunks:
        for layer in range(LAYERS):
            for head in range(HEADS):
                k, v, _ = chunk.head(layer, head)
                at = int(counts[layer, head])
                rows[0, layer, head, at : at + k.shape[0]] = k
                rows[1, layer, head, at : at + k.shape[0]] = v
                counts[layer, head] += k.shape[0]
    width = len(chunks) * SLOTS
    keys, values = (
        torch.stack([dense_image(r[i], counts[i], width, BS) for i in range(LAYERS)]) for r in rows
    )
    return keys, values, counts


@pytest.mark.parametrize("limit", [1, 10**9])  # one layer per run, or all at once
def test_cell_images_equal_a_plain_loop_in_any_run_of_layers(limit: int) -> None:
    chunks = [_chunk(seed) for seed in range(3)]
    want_keys, want_values, want_counts = _loop(chunks)
    runs = layer_runs(LAYERS, layer_bytes=100, limit=limit)
    assert runs == ([(0, 1), (1, 2), (2, 3)] if limit == 1 else [(0, 3)])
    got = [cell_images(chunks, lo, hi, 3 * SLOTS, BS, torch.device("cpu")) for lo, hi in runs]
    keys, values, counts = (torch.cat(part) for part in zip(*got, strict=True))
    assert torch.equal(keys.view(torch.int16), want_keys.view(torch.int16))  # bit for bit
    assert torch.equal(values.view(torch.int16), want_values.view(torch.int16))
    assert torch.equal(counts, want_counts)
    assert int(counts[0].sum()) == 3 * SLOTS * HEADS  # layer 0 fills its cells: no zeros
    head0 = dense_rows(keys[0], counts[0], BS)[0]  # read back: chunk 0's rows, then 1's
    assert torch.equal(head0, torch.cat([c.head(0, 0)[0] for c in chunks]))


def test_rows_over_a_layers_cells_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        cell_images([_chunk(0)], 0, LAYERS, SLOTS - BS, BS, torch.device("cpu"))


@pytest.mark.parametrize("layout_name", ["head_major_kt", "token_major"])
def test_write_per_head_writes_the_loops_cells_and_counts(layout_name: str) -> None:
    from connectors.vllm.metadata import LoadSpec  # the worker imports vLLM
    from connectors.vllm.worker import Worker

    chunks = [_chunk(seed) for seed in range(4)]
    keys, values, counts = _loop(chunks)
    layout = make_layout(layout_name, BS)
    start, width = 2 * BS, len(chunks) * SLOTS  # two blocks of vLLM's own hit first
    kv = {
        f"l{i}": torch.full((12, HEADS, BS, 2 * D), 7.0, dtype=torch.bfloat16)
        for i in range(LAYERS)
    }
    index = {name: i for i, name in enumerate(kv)}
    worker = SimpleNamespace(
        perhead=PerHeadAttention(layout, kv, index, dict.fromkeys(kv, 1 / math.sqrt(D)), D),
        kv_caches=kv,
        layer_index=index,
        layout=layout,
        slots=SLOTS,
        facts=SimpleNamespace(block_size=BS, num_kv_heads=HEADS, num_layers=LAYERS),
    )
    row = [7, 3, 11, 0, 5, 9, 1, 2, 10, 4]  # start + width = 20 slots: 10 blocks
    Worker._write_per_head(worker, LoadSpec("r", row, start, []), chunks)  # type: ignore[arg-type]
    want = {name: torch.full_like(pages, 7.0) for name, pages in kv.items()}  # others untouched
    for name, i in index.items():
        layout.write(want[name], row, start, keys[i], values[i])
        assert torch.equal(kv[name].view(torch.int16), want[name].view(torch.int16))
    entry = worker.perhead.entries["r"]
    assert torch.equal(entry.counts, counts + start)
    assert (entry.first_block, entry.reserved, entry.base) == (7, start + width, start)
