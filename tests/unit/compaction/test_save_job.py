"""Compacting a request's pages into stored chunks (``lmcompact.compaction.save_job``):
window scores, uniform and per-head counts, kept positions (engine-free)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.attention.scores import window_scores
from lmcompact.compaction.chunks import chunk_problem, fit_layer
from lmcompact.compaction.page_layout import CpuPageLayout
from lmcompact.compaction.save_job import (
    SaveJob,
    compact_job,
    observe_layer,
    uniform_keep,
    window_masses,
)
from lmcompact.policies import Need, make_policy
from lmcompact.store import ChunkKeyer, StoreNamespace
from tests.unit.compaction.test_query_agnostic_save import CHUNK, LAYERS, NEEDLE, _job

RAGGED = {"allocation": "ragged", "share": False, "kernel_size": 1}


def test_observe_layer_on_cpu_is_the_reference_exactly() -> None:
    """Off CUDA the window mass is the torch reference with the same arguments as before."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3000, 8, generator=gen)
    queries = torch.randn(16, 6, 8, generator=gen)
    positions = torch.arange(3100 - 16, 3100)
    for needs in (Need.WINDOW_SCORES, Need.WINDOW_ATTENTION):
        mass, rows = observe_layer(keys, keys, queries, positions, 100, needs, 0.3, torch.bfloat16)
        want, want_rows = window_scores(
            queries.permute(1, 0, 2)[None],
            keys[None],
            query_positions=positions - 100,
            scale=0.3,
            chunk_size=1024,
            return_attention=needs is Need.WINDOW_ATTENTION,
        )
        assert mass is not None and torch.equal(mass, want[0])
        assert (rows is None) == (want_rows is None)
        if rows is not None and want_rows is not None:
            assert torch.equal(rows, want_rows[0])


def test_uniform_keep_pads_and_trims() -> None:
    assert uniform_keep(torch.tensor([0, 5]), 4, 10).tolist() == [0, 5, 8, 9]
    assert uniform_keep(torch.tensor([0, 1, 2, 3, 4, 5]), 4, 10).tolist() == [0, 1, 4, 5]


def test_compact_job_keeps_budget_and_positions() -> None:
    bs, h, d, layers, chunk = 32, 2, 16, 2, 64
    layout = CpuPageLayout(bs)
    keys = [torch.randn(h, 3 * bs, d) for _ in range(layers)]
    values = [torch.randn(h, 3 * bs, d) for _ in range(layers)]
    pages = [layout.tokens_to_pages(k, v) for k, v in zip(keys, values, strict=True)]
    ns = StoreNamespace("m", "float32", "rows")
    chunk_keys = ChunkKeyer(ns, chunk).keys(list(range(3 * bs)))
    queries = [torch.randn(8, 2 * h, d) for _ in range(layers)]
    job = SaveJob("r", chunk_keys, 0, 3 * bs, pages, queries, torch.arange(88, 96), d**-0.5)
    ((key, out),) = compact_job(job, layout, make_policy("snapkv", budget=0.5), chunk, 32)
    assert key == chunk_keys[0]
    assert out.uniform_count() == 32 and out.num_tokens == chunk
    for layer in range(layers):
        for head in range(h):
            k, v, pos = out.head(layer, head)
            assert torch.equal(k, keys[layer][head, pos.long()])
            assert torch.equal(v, values[layer][head, pos.long()])


def _window_job(policy_window: int = 8) -> tuple[SaveJob, CpuPageLayout]:
    bs, h, d, layers = 32, 2, 16, 3
    layout = CpuPageLayout(bs)
    torch.manual_seed(0)
    pages = [layout.tokens_to_pages(torch.randn(h, 4 * bs, d), torch.randn(h, 4 * bs, d))]
    pages += [layout.tokens_to_pages(torch.randn(h, 4 * bs, d), torch.randn(h, 4 * bs, d))]
    pages += [layout.tokens_to_pages(torch.randn(h, 4 * bs, d), torch.randn(h, 4 * bs, d))]
    keys = ChunkKeyer(StoreNamespace("m", "float32", "rows"), 128).keys(list(range(4 * bs)))
    queries = [torch.randn(policy_window, 2 * h, d) for _ in range(layers)]
    positions = torch.arange(4 * bs - policy_window, 4 * bs)
    return SaveJob("r", keys, 0, 4 * bs, pages, queries, positions, d**-0.5), layout


@pytest.mark.parametrize("policy", ["snapkv", "tova", "knorm", "streaming_llm", "pyramidkv"])
def test_window_scores_computed_at_copy_time_give_the_same_chunks(policy: str) -> None:
    """The GPU save computes window scores where the pages are (window_masses) and the
    job uses them; with the same arithmetic (here both on the CPU) the chunks are equal."""
    job, layout = _window_job()
    compaction = make_policy(policy, budget=0.5)
    want = compact_job(job, layout, compaction, 128, 64)
    masses = window_masses(job, layout, compaction)
    needs_scores_only = (
        Need.WINDOW_SCORES in compaction.needs and Need.WINDOW_ATTENTION not in compaction.needs
    )
    assert (masses is not None) == needs_scores_only
    if masses is None:
        return
    assert [m.shape for m in masses] == [(2, job.num_tokens)] * 3
    job.window_mass = masses
    got = compact_job(job, layout, compaction, 128, 64)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
    job.window_mass = [torch.zeros_like(m) for m in masses]  # the masses are what decides
    other = compact_job(job, layout, compaction, 128, 64)
    pairs = zip(other, want, strict=True)
    assert any(not torch.equal(a.positions, b.positions) for (_, a), (_, b) in pairs)


def test_ragged_job_keeps_per_head_counts_within_the_cap_and_the_budget_on_average() -> None:
    policy = make_policy("kvzip", budget=0.25, n_sink=2, window=8, max_queries=64, **RAGGED)
    positions = policy.context_queries(192)
    assert positions is not None
    generator = torch.Generator().manual_seed(1)
    queries = [torch.randn(positions.numel(), 4, 16, generator=generator) for _ in range(LAYERS)]
    for q in queries:  # head 0's queries (group of kv head 0) read the needle hard
        q[:, :2] = torch.nn.functional.normalize(torch.ones(16), dim=0) * 40.0
    job, layout, _ = _job(queries, positions, window=8)
    uniform = compact_job(job, layout, policy, CHUNK, 16)
    ragged = compact_job(job, layout, policy, CHUNK, 16, cap=32)
    assert all(chunk.uniform_count() == 16 for _, chunk in uniform)  # no cap: K everywhere
    spread = False
    for c, (_, chunk) in enumerate(ragged):
        counts = chunk.kept_counts
        assert int(counts.sum()) == counts.numel() * 16 and int(counts.max()) <= 32
        spread |= counts.unique().numel() > 1
        assert chunk_problem(chunk, _Facts(), CHUNK, 16, cap=32) is None
        assert chunk_problem(chunk, _Facts(), CHUNK, 16, cap=8) is not None  # over a cap
        if c == 1:
            assert all(NEEDLE - CHUNK in chunk.head(0, h)[2].tolist() for h in range(2))
    assert spread, "the ragged allocation gave every (layer, head) the same count"
    # a uniform loader refuses ragged chunks (and a ragged loader takes uniform ones)
    ragged_chunk = next(chunk for _, chunk in ragged if chunk.uniform_count() is None)
    assert chunk_problem(ragged_chunk, _Facts(), CHUNK, 16) is not None
    assert chunk_problem(uniform[0][1], _Facts(), CHUNK, 16, cap=32) is None
    # a layer cap at the mean: every layer's heads keep H x K together, heads still differ
    heads = ragged[0][1].num_kv_heads
    dense = compact_job(job, layout, policy, CHUNK, 16, cap=32, layer_cap=16 * heads)
    for _, chunk in dense:
        assert chunk.kept_counts.sum(dim=1).tolist() == [16 * heads] * LAYERS
        assert chunk_problem(chunk, _Facts(), CHUNK, 16, cap=32, layer_cap=16 * heads) is None
    widest = max(int(c.kept_counts.sum(dim=1).max()) for _, c in ragged)
    assert widest > 16 * heads  # the uncapped chunks: a loader with the layer cap refuses them
    loose = next(c for _, c in ragged if int(c.kept_counts.sum(dim=1).max()) == widest)
    assert "cells" in str(chunk_problem(loose, _Facts(), CHUNK, 16, cap=32, layer_cap=16 * heads))


def test_fit_layer_cuts_the_largest_heads_to_one_level() -> None:
    heads = [torch.arange(n) * 2 for n in (3, 10, 7, 1)]  # 21 kept in all
    assert fit_layer(heads, 21, 40) is heads
    fitted = fit_layer(heads, 14, 40)  # level 5: 3 + 5 + 5 + 1
    assert [p.numel() for p in fitted] == [3, 5, 5, 1]
    assert fitted[1].tolist() == [0, 2, 14, 16, 18]  # first and last choices of the cut head
    assert torch.equal(fitted[0], heads[0])
    with pytest.raises(ValueError, match="cannot keep >= 1"):
        fit_layer(heads, 3, 40)


class _Facts:
    num_layers = LAYERS
    num_kv_heads = 2
    head_dim = 16
    page_dtype = torch.float32
