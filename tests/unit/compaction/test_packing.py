"""pack_in_place on paged CPU and GPU layouts: kept tokens land in the first slots."""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.pack import WindowQueries, pack_in_place, plan_pack
from lmcompact.compaction.page_layout import make_layout
from lmcompact.compaction.per_head import dense_rows
from lmcompact.policies import make_policy

BS, H, D = 8, 2, 4


def paged(num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, H, BS, 2 * D, generator=gen)


@pytest.mark.parametrize("layout_name", ["head_major_kt", "token_major"])
def test_streaming_pack_moves_sinks_and_recent_tokens(layout_name: str) -> None:
    layout = make_layout(layout_name, BS)
    layers = [paged(12, 0), paged(12, 1)]
    row = [9, 3, 5, 0, 11, 2, 7]  # logical -> physical; 6 full blocks compacted, block 6 tail
    before = [layout.read(kv, row, 0, 7 * BS) for kv in layers]
    untouched = [kv[[1, 4, 6, 8, 10]].clone() for kv in layers]
    policy = make_policy("streaming_llm", budget=16, n_sink=2)
    chosen = pack_in_place(layers, layout, row, num_tokens=6 * BS, kept=2 * BS, policy=policy)
    expected = torch.cat([torch.arange(2), torch.arange(6 * BS - 14, 6 * BS)])
    for layer, kv in enumerate(layers):
        keys, values = layout.read(kv, row, 0, 7 * BS)
        old_keys, old_values = before[layer]
        for head in range(H):
            assert torch.equal(chosen[layer][head], expected)
        assert torch.equal(keys[:, : 2 * BS], old_keys[:, expected])
        assert torch.equal(values[:, : 2 * BS], old_values[:, expected])
        assert torch.equal(keys[:, 2 * BS :], old_keys[:, 2 * BS :])  # hole and tail unchanged
        assert torch.equal(kv[[1, 4, 6, 8, 10]], untouched[layer])  # other requests' blocks


@pytest.mark.parametrize("layout_name", ["head_major_kt", "token_major"])
def test_pack_after_shared_blocks_leaves_them_untouched(layout_name: str) -> None:
    """``start``: blocks shared through vLLM's prefix cache are neither read nor written;
    the span after them packs as a pack of that span alone would (window positions are
    absolute)."""
    layout = make_layout(layout_name, BS)
    layers = [paged(12, 7), paged(12, 8)]
    row = [9, 3, 5, 0, 11, 2, 7]
    before = [kv.clone() for kv in layers]
    gen = torch.Generator().manual_seed(2)
    queries = torch.randn(4, H, D, generator=gen)
    policy = make_policy("snapkv", budget=BS, window_size=4, kernel_size=1)
    absolute = WindowQueries([queries] * 2, torch.arange(6 * BS - 4, 6 * BS), scale=1.0)
    chosen = pack_in_place(layers, layout, row, 4 * BS, BS, policy, absolute, start=2 * BS)
    # the same span packed on its own, with window positions relative to it
    alone = [kv.clone() for kv in before]
    relative = WindowQueries([queries] * 2, torch.arange(4 * BS - 4, 4 * BS), scale=1.0)
    expected = pack_in_place(alone, layout, row[2:], 4 * BS, BS, policy, relative)
    for layer, kv in enumerate(layers):
        assert [c.tolist() for c in chosen[layer]] == [e.tolist() for e in expected[layer]]
        assert torch.equal(kv[row[:2]], before[layer][row[:2]])  # shared blocks untouched
        assert torch.equal(kv, alone[layer])
    with pytest.raises(ValueError, match="block-aligned"):
        pack_in_place(layers, layout, row, 4 * BS, BS, policy, absolute, start=BS + 1)


def test_snapkv_pack_uses_window_queries_per_head() -> None:
    layout = make_layout("head_major_kt", BS)
    kv = paged(6, 3)
    row = [0, 1, 2, 3, 4]
    keys, values = layout.read(kv, row, 0, 4 * BS)
    hot = {0: 5, 1: 17}  # a token each head's window query points at
    queries = torch.zeros(4, H, D)
    for head, token in hot.items():
        keys[head, token] = torch.tensor([10.0, 0.0, 0.0, 0.0])
        queries[:, head, 0] = 3.0
    layout.write(kv, row, 0, keys, values)
    window = WindowQueries([queries], torch.arange(4 * BS - 4, 4 * BS), scale=1.0)
    policy = make_policy("snapkv", budget=BS, window_size=4, kernel_size=1)
    chosen = pack_in_place([kv], layout, row, 4 * BS, BS, policy, window)
    packed_keys, _ = layout.read(kv, row, 0, BS)
    for head, token in hot.items():
        assert token in chosen[0][head].tolist()
        slot = chosen[0][head].tolist().index(token)
        assert torch.equal(packed_keys[head, slot], keys[head, token])


@pytest.mark.parametrize(("num_tokens", "kept"), [(30, 8), (32, 12), (32, 32), (32, 0)])
def test_unaligned_or_empty_packs_raise(num_tokens: int, kept: int) -> None:
    layout = make_layout("head_major_kt", BS)
    with pytest.raises(ValueError, match="block-aligned"):
        pack_in_place(
            [paged(6, 0)],
            layout,
            [0, 1, 2, 3, 4],
            num_tokens,
            kept,
            make_policy("streaming_llm", budget=8),
        )


@pytest.mark.parametrize("layout_name", ["head_major_kt", "token_major"])
def test_per_head_pack_keeps_own_counts_as_dense_cells(layout_name: str) -> None:
    """PyramidKV gives layers different counts; a layer's heads are packed as dense cells of
    the reserved slots, head after head, zeros after the last."""
    layout = make_layout(layout_name, BS)
    layers = [paged(12, 4), paged(12, 5), paged(12, 6)]
    row = [9, 3, 5, 0, 11, 2, 7, 1, 4]  # 8 full blocks compacted, block 8 tail
    before = [layout.read(kv, row, 0, 9 * BS) for kv in layers]
    gen = torch.Generator().manual_seed(0)
    window = WindowQueries(
        [torch.randn(4, H, D, generator=gen) for _ in layers],
        torch.arange(8 * BS - 4, 8 * BS),
        scale=0.5,
    )
    policy = make_policy("pyramidkv", budget=BS, window_size=4, kernel_size=1)
    kept, reserved = 2 * BS, 3 * BS
    chosen = pack_in_place(layers, layout, row, 8 * BS, kept, policy, window, reserved=reserved)
    counts = torch.tensor([[k.numel() for k in heads] for heads in chosen])
    assert counts.unique().numel() > 1  # the layers really differ
    assert int(counts.min()) >= 1 and int(counts.sum(dim=1).max()) <= reserved * H
    for layer, kv in enumerate(layers):
        keys, values = layout.read(kv, row, 0, 9 * BS)
        old_keys, old_values = before[layer]
        rows_k = dense_rows(keys[:, :reserved], counts[layer], BS)
        rows_v = dense_rows(values[:, :reserved], counts[layer], BS)
        for head in range(H):
            index = chosen[layer][head]
            assert torch.equal(rows_k[head], old_keys[head, index])
            assert torch.equal(rows_v[head], old_values[head, index])
        used = int(counts[layer].sum())
        cells = keys[:, :reserved].reshape(H, 3, BS, D).transpose(0, 1).reshape(-1, D)
        assert not cells[used:].any()  # cells after the last head's are zero
        assert torch.equal(keys[:, reserved:], old_keys[:, reserved:])  # hole and tail


def test_per_head_pack_clips_counts_to_reserved() -> None:
    """Ada-KV gives the flat-attention head most of the budget; it is clipped to reserved
    and the policy is asked for more, so the other head gets the tokens back."""
    layout = make_layout("head_major_kt", BS)
    kv = paged(8, 7)
    row = [0, 1, 2, 3, 4, 5]
    keys, values = layout.read(kv, row, 0, 4 * BS)
    keys[1, 5] = torch.tensor([10.0, 0.0, 0.0, 0.0])  # head 1's window looks at token 5 only
    layout.write(kv, row, 0, keys, values)
    queries = torch.zeros(4, H, D)  # head 0: flat attention
    queries[:, 1, 0] = 3.0
    window = WindowQueries([queries], torch.arange(4 * BS - 4, 4 * BS), 1.0)
    policy = make_policy(
        "adakv",
        budget=BS,
        alpha_safeguard=0.0,
        scorer_params={"window_size": 4, "kernel_size": 1},
    )
    free = pack_in_place([kv.clone()], layout, row, 4 * BS, BS, policy, window, reserved=3 * BS)
    assert free[0][0].numel() > BS > free[0][1].numel()  # unclipped: head 0 takes more
    chosen = pack_in_place([kv], layout, row, 4 * BS, BS, policy, window, reserved=BS)
    # head 0 clipped to BS; the policy is asked for more until head 1 fills up too
    assert [k.numel() for k in chosen[0]] == [BS, BS]
    assert set(free[0][1].tolist()) <= set(chosen[0][1].tolist()) and 5 in chosen[0][1].tolist()
    with pytest.raises(ValueError, match="reserved"):
        pack_in_place([kv], layout, row, 4 * BS, 2 * BS, policy, window, reserved=BS)


def test_per_head_plan_asks_for_more_when_clipping_lowers_the_mean() -> None:
    """PyramidKV (beta 4) wants ~25 tokens in layer 0 and ~7 in layer 1 at a mean of 16;
    layer 0 is clipped to 24, so the policy is asked again until the mean is 16."""
    gen = torch.Generator().manual_seed(2)
    per_layer = [(torch.randn(H, 8 * BS, D, generator=gen),) * 2 for _ in range(2)]
    window = WindowQueries(
        [torch.randn(4, H, D, generator=gen) for _ in range(2)], torch.arange(60, 64), 1.0
    )
    policy = make_policy("pyramidkv", budget=2 * BS, window_size=4, kernel_size=1, beta=4.0)
    once = plan_pack(per_layer, policy, 2 * BS, window, reserved=8 * BS - 1)
    assert [k.numel() for k in once[0]] == [25, 25] and [k.numel() for k in once[1]] == [7, 7]
    chosen = plan_pack(per_layer, policy, 2 * BS, window, reserved=3 * BS)
    counts = torch.tensor([[k.numel() for k in heads] for heads in chosen])
    assert counts[0].tolist() == [3 * BS, 3 * BS]  # clipped
    assert 2 * BS <= float(counts.float().mean()) < 2 * BS + 2  # mean back at the budget
