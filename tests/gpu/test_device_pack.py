"""The device-resident pack on CUDA against the torch references (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.device_pack import DevicePacker
from lmcompact.compaction.pack import WindowQueries, pack_in_place
from lmcompact.compaction.page_layout import make_layout
from lmcompact.kernels.paged_pack import (
    gather_pages,
    gather_pages_reference,
    layer_pointers,
    scatter_kept,
    scatter_kept_reference,
)
from lmcompact.policies.registry import make_policy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def paged(layers: int, blocks: int, heads: int, bs: int, dim: int, dtype: torch.dtype, seed: int):
    """vLLM 0.26 strides: memory order block -> token -> head -> (K | V)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(blocks, bs, heads, 2 * dim, device="cuda", generator=gen)
        .to(dtype)
        .permute(0, 2, 1, 3)
        for _ in range(layers)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("bs", "dim"), [(16, 64), (32, 128)])
def test_gather_and_scatter_match_references(dtype: torch.dtype, bs: int, dim: int) -> None:
    layers = paged(4, 70, 8, bs, dim, dtype, seed=bs)
    row = torch.randperm(69, device="cuda")[:40] + 1
    ptrs = layer_pointers(layers)
    got = gather_pages(layers, ptrs, row)
    want = gather_pages_reference(layers, row)
    assert torch.equal(got, want)
    kept = 10 * bs
    index = torch.stack(
        [torch.randperm(40 * bs, device="cuda")[:kept].sort().values for _ in range(4 * 8)]
    ).view(4, 8, kept)
    ref = [kv.clone() for kv in layers]
    scatter_kept(layers, ptrs, row, got, index)
    scatter_kept_reference(ref, row, want, index)
    assert all(torch.equal(a, b) for a, b in zip(layers, ref, strict=True))


@pytest.mark.parametrize("name", ["snapkv", "streaming_llm", "knorm"])
def test_device_pack_matches_reference_pack(name: str) -> None:
    layers_n, heads, group, dim, bs, window, tokens = 4, 8, 4, 128, 32, 32, 4096
    layout = make_layout("token_major", bs)
    kv = paged(layers_n, tokens // bs + 4, heads, bs, dim, torch.bfloat16, seed=5)
    ref = [k.clone() for k in kv]
    row = list(range(3, 3 + tokens // bs))
    gen = torch.Generator(device="cuda").manual_seed(9)
    queries = [
        torch.randn(window, heads * group, dim, device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(layers_n)
    ]
    positions = torch.arange(tokens - window, tokens)
    policy = make_policy(name)
    kept = tokens // 4
    win = WindowQueries([q.float() for q in queries], positions, dim**-0.5)
    chosen = pack_in_place(ref, layout, row, tokens, kept, policy, win)
    packer = DevicePacker(kv, bs, dim**-0.5)
    index = packer.pack(
        row, tokens, kept, policy, torch.stack(queries).permute(0, 2, 1, 3), positions
    )
    want = torch.stack([torch.stack(h) for h in chosen]).cuda()
    # same kernel and float64 selection: equal up to rare near-ties of the batched kernel
    assert float((index == want).float().mean()) > 0.99
    assert torch.equal(index, index.sort(dim=-1).values)
    # the pages hold exactly the tokens the device pack chose, in order
    originals = paged(layers_n, tokens // bs + 4, heads, bs, dim, torch.bfloat16, seed=5)
    for layer in range(layers_n):
        old_k, old_v = layout.read(originals[layer], row, 0, tokens)
        new_k, new_v = layout.read(kv[layer], row, 0, kept)
        gather = index[layer].unsqueeze(-1).expand(-1, -1, dim)
        assert torch.equal(new_k, torch.gather(old_k, 1, gather))
        assert torch.equal(new_v, torch.gather(old_v, 1, gather))


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("snapkv", {"window_size": 16}),
        ("chunkkv", {"window_size": 16}),
        ("pyramidkv", {"window_size": 16}),
        ("adakv", {"scorer_params": {"window_size": 16}}),
    ],
)
@pytest.mark.parametrize("capped", [False, True])
def test_window_scored_plans_on_cuda_match_the_host(
    name: str, params: dict[str, object], capped: bool
) -> None:
    """Window-scored policies rank where the window scores are: the same keep plan from
    CUDA scores as from their host copy (Ada-KV's per-head caps included)."""
    from lmcompact.policies.inputs import CompactionInputs, LayerObservation

    layers, heads, length = 4, 8, 2048
    gen = torch.Generator().manual_seed(len(name))
    scores = torch.rand(layers, heads, length, generator=gen)
    valid = torch.rand(heads, length, generator=gen) > 0.05
    policy = make_policy(name, budget=0.25, **params)

    def plan(device: str) -> list[list[list[int]]]:
        inputs = CompactionInputs(
            num_candidates=length,
            num_kv_heads=heads,
            layers=[LayerObservation(window_scores=s.to(device)) for s in scores],
            valid=valid,
            max_tokens=length // 2 if capped else None,
            max_layer_tokens=heads * length // 3 if capped else None,
        )
        kept = policy.plan(inputs).kept
        return [[k.cpu().tolist() for k in layer] for layer in kept]

    assert plan("cuda") == plan("cpu")


def test_window_score_warm_up_tunes_every_length() -> None:
    from lmcompact.kernels.window_scores import warm_up, warm_up_lengths

    done = warm_up(8, 2, 64, 16, 9000, torch.bfloat16, torch.device("cuda"), 0.125)
    assert [tokens for tokens, _ in done] == warm_up_lengths(9000) == [1024, 4096, 8192, 9000]


@pytest.mark.parametrize("name", ["adakv", "pyramidkv"])
@pytest.mark.parametrize("head_cap", [None, 1536])
def test_per_head_device_pack_matches_reference_pack(head_cap: int | None, name: str) -> None:
    """Ada-KV and PyramidKV per-head cells on CUDA (Triton gather, batched ranking) against
    the reference pack: the same counts and cells, up to rare near-ties of the batched
    score kernel."""

    layers_n, heads, group, dim, bs, window, tokens = 4, 8, 4, 128, 32, 32, 4096
    layout = make_layout("token_major", bs)
    kv = paged(layers_n, tokens // bs + 4, heads, bs, dim, torch.bfloat16, seed=7)
    ref = [k.clone() for k in kv]
    row = list(range(3, 3 + tokens // bs))
    gen = torch.Generator(device="cuda").manual_seed(11)
    queries = [
        torch.randn(window, heads * group, dim, device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(layers_n)
    ]
    positions = torch.arange(tokens - window, tokens)
    policy = make_policy(name)
    kept, reserved = tokens // 4, tokens // 4 + tokens // 8
    win = WindowQueries([q.float() for q in queries], positions, dim**-0.5)
    chosen = pack_in_place(
        ref, layout, row, tokens, kept, policy, win, reserved=reserved, head_cap=head_cap
    )
    packer = DevicePacker(kv, bs, dim**-0.5)
    counts = packer.pack_per_head(
        row,
        tokens,
        kept,
        reserved,
        head_cap,
        policy,
        torch.stack(queries).permute(0, 2, 1, 3),
        positions,
    )
    want = torch.tensor([[k.numel() for k in layer] for layer in chosen], device="cuda")
    counts = counts.to(want.device)
    assert torch.equal(counts.sum(dim=1), want.sum(dim=1))  # the same per-layer totals
    assert float((counts - want).abs().sum()) <= 0.01 * float(want.sum())
    if torch.equal(counts, want):
        same = [float((a == b).float().mean()) for a, b in zip(kv, ref, strict=True)]
        assert min(same) > 0.99, same
