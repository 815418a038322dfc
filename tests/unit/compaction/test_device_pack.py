"""Batched device scorers and selection (torch, any device) equal the policies' own plans."""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.device_pack import DEVICE_SCORERS, device_scores, select_kept
from lmcompact.policies import CompactionInputs, LayerObservation, make_policy

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
