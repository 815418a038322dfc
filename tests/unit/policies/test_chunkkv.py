"""ChunkKV against a direct reference: whole chunks by summed window mass, the same for
every head; the partial chunk by its tokens' mass; the observation window always."""

from __future__ import annotations

import pytest
import torch

from lmcompact.policies import make_policy
from tests.unit.policies.cases import synthetic_inputs


def reference_keep(scores: torch.Tensor, keep: int, window: int, chunk: int) -> list[int]:
    """Positions kept from ``(H, T)`` window scores: the last ``window``, then chunks in
    order of their mass over all heads, then the best tokens of the next chunk."""
    length = scores.shape[1]
    window = min(window, keep)
    kept = list(range(length - window, length))
    mass = scores.double().sum(0)
    mass[length - window :] = 0.0
    chunks = [list(range(s, min(s + chunk, length))) for s in range(0, length, chunk)]
    order = sorted(chunks, key=lambda c: -sum(float(mass[p]) for p in c))
    for c in order:
        free = [p for p in c if p not in kept]
        room = keep - len(kept)
        if room <= 0:
            break
        kept += sorted(free, key=lambda p: -float(mass[p]))[:room]
    return sorted(kept)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunkkv_keeps_what_the_reference_keeps(seed: int, chunk: int) -> None:
    inputs = synthetic_inputs(2, 3, 61, 8, seed=seed)
    policy = make_policy("chunkkv", budget=22, window_size=5, chunk_size=chunk)
    plan = policy.plan(inputs)
    for layer, heads in enumerate(plan.kept):
        scores = inputs.layers[layer].window_scores
        assert scores is not None
        expected = reference_keep(scores, 22, 5, chunk)
        for kept in heads:  # every head keeps the layer's chunks
            assert kept.tolist() == expected


def test_chunkkv_keeps_a_whole_number_snapkv_splits() -> None:
    """A label the window attends to, with a 5-token number before it: SnapKV (no pooling)
    keeps the label and the number's last token; ChunkKV keeps the chunk holding both."""
    inputs = synthetic_inputs(1, 1, 40, 8, seed=0)
    scores = torch.full((1, 40), 0.01)
    scores[0, 12:17] = 0.02  # the digits
    scores[0, 17:19] = 1.0  # the label
    inputs.layers[0].window_scores = scores
    snap = make_policy("snapkv", budget=6, window_size=2, kernel_size=1).plan(inputs)
    chunk = make_policy("chunkkv", budget=12, window_size=2, chunk_size=10).plan(inputs)
    assert not set(range(12, 17)) <= set(snap.kept[0][0].tolist())
    assert chunk.kept[0][0].tolist() == [*range(10, 20), 38, 39]


@pytest.mark.parametrize("params", [{"chunk_size": 0}, {"window_size": -1}])
def test_chunkkv_refuses_bad_parameters(params: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be >= "):
        make_policy("chunkkv", budget=8, **params)
