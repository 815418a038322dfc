"""Batched device scorers and selection (torch, any device) equal the policies' own plans."""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.device_pack import (
    DEVICE_SCORERS,
    DevicePacker,
    device_scores,
    select_kept,
)
from lmcompact.compaction.pack import WindowQueries, pack_in_place
from lmcompact.compaction.page_layout import make_layout
from lmcompact.policies import CompactionInputs, LayerObservation, make_policy
from lmcompact.policies.adakv import AdaKV

CASES = [
    ("snapkv", {}),
    ("snapkv", {"window_size": 4, "kernel_size": 5, "pooling": "avgpool"}),
    ("snapkv", {"window_size": 40, "kernel_size": 1}),  # window larger than the budget
    ("streaming_llm", {"n_sink": 4}),
    ("streaming_llm", {"n_sink": 0}),
    ("knorm", {}),
]


@pytest.mark.parametrize(("name", "params"), CASES)
def test_batched_selection_equals_policy_plan(name: str, params: dict[str, object]) -> None:
    layers, heads, length, dim, kept = 3, 2, 96, 8, 24
    gen = torch.Generator().manual_seed(len(name) + len(params))
    keys = torch.randn(layers, heads, length, dim, generator=gen)
    mass = torch.rand(layers, heads, length, generator=gen)
    mass[0, 0, 10:20] = 0.5  # ties: pooled and raw
    policy = make_policy(name, **params)
    inputs = CompactionInputs(
        length,
        heads,
        [
            LayerObservation(keys=keys[i], values=keys[i], window_scores=mass[i])
            for i in range(layers)
        ],
        budget_tokens=kept,
    )
    plan = policy.plan(inputs)
    got = select_kept(device_scores(policy, mass, keys, kept), kept)
    assert got.shape == (layers, heads, kept)
    for layer in range(layers):
        for head in range(heads):
            assert torch.equal(got[layer, head], plan.kept[layer][head]), (layer, head)


def test_scorers_cover_the_benchmark_policies() -> None:
    assert {"snapkv", "streaming_llm", "knorm"} <= set(DEVICE_SCORERS)


PER_HEAD = [
    ("adakv", {"scorer": "snapkv", "scorer_params": {"window_size": 4}}),
    ("adakv", {"scorer": "streaming_llm", "scorer_params": {"n_sink": 2}}),
    ("adakv", {"scorer": "knorm"}),
    # layer 0 asks ~1.9x the mean: clipped to the cells, the budget search asks for more
    ("pyramidkv", {"window_size": 4}),
    ("pyramidkv", {"window_size": 8, "beta": 2.0, "kernel_size": 3}),
]


@pytest.mark.parametrize("head_cap", [None, 40])
@pytest.mark.parametrize(("name", "params"), PER_HEAD)
def test_per_head_device_pack_equals_reference_pack(
    head_cap: int | None, name: str, params: dict[str, object]
) -> None:
    """The batched per-head packs (Ada-KV over each device scorer, PyramidKV) write the
    cells and counts the reference pack (:func:`lmcompact.compaction.pack.pack_in_place`
    with ``reserved``) writes."""
    layers_n, heads, group, dim, bs, window, tokens = 3, 4, 2, 16, 8, 8, 128
    layout = make_layout("token_major", bs)
    gen = torch.Generator().manual_seed(3)
    kv = [
        torch.randn(tokens // bs + 3, bs, heads, 2 * dim, generator=gen).permute(0, 2, 1, 3)
        for _ in range(layers_n)
    ]
    ref = [k.clone() for k in kv]
    row = list(range(2, 2 + tokens // bs))
    queries = [torch.randn(window, heads * group, dim, generator=gen) for _ in range(layers_n)]
    positions = torch.arange(tokens - window, tokens)
    policy = make_policy(name, **params)
    assert DevicePacker.supports_per_head(policy)
    kept, reserved = 32, 48
    chosen = pack_in_place(
        ref,
        layout,
        row,
        tokens,
        kept,
        policy,
        WindowQueries(queries, positions, dim**-0.5),
        reserved=reserved,
        head_cap=head_cap,
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
    want = torch.tensor([[k.numel() for k in layer] for layer in chosen])
    assert torch.equal(counts, want)
    assert int(counts.max()) <= (reserved if head_cap is None else head_cap)
    assert float(counts.double().mean()) >= kept  # the budget, after any cut
    if name == "adakv":
        assert len(set(counts.sum(dim=1).tolist())) == 1  # every layer keeps k x H
    for got, expected in zip(kv, ref, strict=True):
        assert torch.equal(got, expected)


def test_per_head_device_pack_refuses_what_it_cannot_pack() -> None:
    kv = [torch.zeros(6, 2, 8, 16) for _ in range(2)]
    packer = DevicePacker(kv, 8, 0.25)
    policy = make_policy("adakv")
    assert isinstance(policy, AdaKV)
    with pytest.raises(ValueError, match="block-aligned"):
        packer.pack_per_head(range(1, 5), 32, 8, 32, None, policy, None, None)
    assert not DevicePacker.supports_per_head(make_policy("adakv", alpha_safeguard=0.0))
    assert not DevicePacker.supports_per_head(make_policy("adakv", scorer="tova"))
    assert not DevicePacker.supports_per_head(make_policy("snapkv"))
