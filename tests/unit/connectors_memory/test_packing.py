"""pack_in_place on paged CPU and GPU layouts: kept tokens land in the first slots."""

from __future__ import annotations

import pytest
import torch

from connectors.kv_layout import make_layout
from connectors.memory.packing import WindowQueries, pack_in_place
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
