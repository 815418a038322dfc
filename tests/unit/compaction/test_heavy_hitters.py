"""H2O decode, engine-free: the merge keeps each head's top scores, the scores follow their
tokens, the planner leaves room for a kept region, and the per-step key mass equals a
softmax over the keys vLLM attends to (a stand-in metadata with the three fields read; the
engine's own is exercised in tests/integration/vllm_release/test_h2o_decode.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lmcompact.compaction.heavy_hitters import HeavyHitterScores, MergeJob, merge_heavy_hitters
from lmcompact.compaction.hole_planner import HolePlanner, PrefillMode
from lmcompact.compaction.holes import Hole, skip_holes
from lmcompact.compaction.page_layout import make_layout

BS, H, G, D, L = 4, 2, 2, 8, 2
SCALE = 1 / math.sqrt(D)
LAYOUTS = ["head_major_kt", "token_major"]


def caches(num_blocks: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(num_blocks, H, BS, 2 * D, generator=gen) for _ in range(L)]


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_merge_keeps_top_k_per_head_and_moves_scores(layout_name: str) -> None:
    layout = make_layout(layout_name, BS)
    kv = caches()
    kept_blocks, merged_blocks, sinks = [5, 2, 9], [7], BS  # K = 12, M = 4, s = 4
    before = [layout.read(layer, kept_blocks + merged_blocks, 0, 16) for layer in kv]
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(L, H, 20, generator=gen)  # slots 16..19: the tail after the block
    original = scores.clone()

    merged, chosen = merge_heavy_hitters(kv, layout, scores, kept_blocks, merged_blocks, sinks)

    for layer in range(L):
        keys_after, values_after = layout.read(kv[layer], kept_blocks, 0, 12)
        for head in range(H):
            candidates = original[layer, head, 4:16]  # kept region minus sinks + the block
            top = torch.topk(candidates, 8).indices.sort().values
            assert torch.equal(chosen[layer][head], top)
            keys_before, values_before = before[layer]
            assert torch.equal(keys_after[head, :4], keys_before[head, :4])  # sinks stay
            assert torch.equal(keys_after[head, 4:], keys_before[head, 4 + top])
            assert torch.equal(values_after[head, 4:], values_before[head, 4 + top])
            assert torch.equal(merged[layer, head, 4:12], candidates[top])  # scores moved
    assert torch.equal(merged[:, :, :4], original[:, :, :4])
    assert torch.equal(merged[:, :, 12:16], original[:, :, 16:20])  # the tail shifts down
    assert not merged[:, :, 16:].any()
    # some head really took tokens of the merged block (else this test proves little)
    assert any(bool((c >= 8).any()) for per_layer in chosen for c in per_layer)


def test_merge_ties_keep_the_older_tokens() -> None:
    layout = make_layout("token_major", BS)
    kv = caches()
    keys_before, _ = layout.read(kv[0], [1, 2], 0, 2 * BS)
    merged, chosen = merge_heavy_hitters(kv, layout, torch.zeros(L, H, 12), [1, 2], [3], BS)
    assert all(torch.equal(c, torch.arange(BS)) for per_layer in chosen for c in per_layer)
    assert torch.equal(layout.read(kv[0], [1, 2], 0, 2 * BS)[0], keys_before)
    assert merged.shape == (L, H, 12)


def test_merge_rejects_bad_input() -> None:
    layout = make_layout("token_major", BS)
    kv = caches()
    with pytest.raises(ValueError, match="sinks"):
        merge_heavy_hitters(kv, layout, torch.zeros(L, H, 12), [1], [3], BS)  # sinks only
    with pytest.raises(ValueError, match="scores must be"):
        merge_heavy_hitters(kv, layout, torch.zeros(L, H, 8), [1, 2], [3], BS)


def test_planner_opens_decode_hole_after_the_kept_region() -> None:
    planner = HolePlanner(
        BS, PrefillMode.OFF, budget=1.0, decode_budget_blocks=6, decode_recent_blocks=2
    )
    assert not planner.grow_for_decode("r", 1, 3 * BS, 6 * BS, step=0)
    assert planner.grow_for_decode("r", 1, 3 * BS, 7 * BS + 1, step=1)
    hole = planner.holes["r"]
    assert (hole.start, hole.length) == (4, 1)  # kept region = blocks 0-3, block 4 merged
    assert planner.grow_for_decode("r", 1, 3 * BS, 9 * BS, step=2)
    assert (hole.start, hole.length) == (4, 3)
    recent = HolePlanner(BS, PrefillMode.OFF, budget=1.0, decode_budget_blocks=6)
    assert recent.grow_for_decode("r", 1, 3 * BS, 7 * BS, step=1)
    assert recent.holes["r"].start == 1  # StreamingLLM: the hole follows the sinks
    with pytest.raises(ValueError, match="decode_recent_blocks"):
        HolePlanner(BS, PrefillMode.OFF, 1.0, decode_budget_blocks=6, decode_recent_blocks=5)


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_key_mass_accumulates_over_the_keys_attention_sees(layout_name: str) -> None:
    layout = make_layout(layout_name, BS)
    kv = caches(24)
    names = {f"l{i}": i for i in range(L)}
    heavy = HeavyHitterScores(
        layout,
        dict(zip(names, kv, strict=True)),
        names,
        dict.fromkeys(names, SCALE),
        D,
        num_kv_heads=H,
    )
    rows = {"a": [3, 9, 1, 14, 6, 2, 11], "b": [4, 5, 7, 8]}  # a: kept 0-1, hole 2-4, tail 5-6
    logical = {"a": 7 * BS - 2, "b": 4 * BS - 1}
    table = torch.zeros(2, 7, dtype=torch.int32)
    for i, row in enumerate(rows.values()):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    edited = skip_holes(table, torch.tensor(list(logical.values())), 2, {3: Hole(3, 2, 3)}, BS)
    assert edited is not None
    metadata = SimpleNamespace(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        block_table=edited[0],
        seq_lens=edited[1],
    )
    heavy.begin_step([], {3: "a"}, [])  # only request a is scored
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(2, H * G * D, generator=gen)
    for name in names:
        heavy(name, query, metadata, torch.zeros(2, H * G * D))
        heavy(name, query, metadata, torch.zeros(2, H * G * D))  # two steps' worth
    visible = 7 * BS - 2 - 3 * BS
    assert set(heavy.scores) == {"a"}
    for layer in names.values():
        kept_k, _ = layout.read(kv[layer], rows["a"][:2], 0, 2 * BS)
        tail_k, _ = layout.read(kv[layer], rows["a"][5:], 0, visible - 2 * BS)
        keys = torch.cat([kept_k, tail_k], dim=1)  # (H, visible, D)
        q = query[0].view(H, G, D)
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys) * SCALE, dim=-1)
        expected = 2 * probs.mean(dim=1)
        got = heavy.scores["a"][layer]
        torch.testing.assert_close(got[:, :visible], expected)
        assert not got[:, visible:].any()
    # the paged-kernel path (CUDA; its torch reference here) gives the same mass
    rows = heavy._batch_rows(metadata, torch.device("cpu"))
    assert rows is not None
    queries = query.view(2, H * G, D)[rows.query_index]
    for layer in names.values():
        mass = heavy._kernel_mass(kv[layer], queries, rows, SCALE)
        torch.testing.assert_close(2 * mass[0, :, :visible], heavy.scores["a"][layer, :, :visible])
    # a merge shifts the scores; forgetting the request drops them
    heavy.begin_step([MergeJob("a", (3, 9), (14,), BS)], {}, [])
    assert heavy.stats["merges"] == 1
    heavy.begin_step([], {}, ["a"])
    assert heavy.scores == {}


def test_merge_on_sliding_layers_keeps_the_newest_candidates() -> None:
    layout = make_layout("token_major", BS)
    kv = caches()
    kept_blocks, merged_blocks = [5, 2, 9], [7]
    before = layout.read(kv[0], kept_blocks + merged_blocks, 0, 16)[0]
    scores = torch.rand(L, H, 20, generator=torch.Generator().manual_seed(1))
    original = scores.clone()
    merged, chosen = merge_heavy_hitters(
        kv, layout, scores, kept_blocks, merged_blocks, BS, recent_layers=frozenset({0})
    )
    assert torch.equal(chosen[0], torch.arange(4, 12).expand(H, -1))
    after = layout.read(kv[0], kept_blocks, 0, 12)[0]
    assert torch.equal(after[:, :BS], before[:, :BS]) and torch.equal(after[:, BS:], before[:, 8:])
    assert torch.equal(merged[0, :, 4:12], original[0, :, 8:16])  # their scores move with them
    top = torch.topk(original[1, :, 4:16], 8).indices.sort().values
    assert torch.equal(chosen[1], top)  # the other layer still keeps its heavy hitters
