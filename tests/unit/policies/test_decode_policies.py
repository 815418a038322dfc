"""The decode policies against torch references written from their papers, loop by loop.

``decoding_snapkv``: softmax attention of the window queries over every key they see
(causal), summed over the window, averaged over each GQA group, max-pooled; the window
kept; top-k of the rest. ``rkv``: the R-KV score (arXiv 2505.24133) computed per head with
explicit loops over key pairs. Both on decode-like candidates too (per-head positions,
padding), where the padding must never be kept.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmcompact.policies import CompactionInputs, LayerObservation, make_policy
from lmcompact.policies.rkv import RKV

HEADS, GROUP, LENGTH, DIM, WINDOW = 2, 3, 40, 16, 6


def attention_rows(
    queries: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
) -> torch.Tensor:
    """``(H, W, T)`` softmax rows of ``queries (H * G, W, D)`` over ``keys (H, T, D)``, a
    key visible when its position is at most the query's; GQA groups averaged."""
    rows = torch.zeros(HEADS, len(q_pos), keys.shape[1], dtype=torch.float64)
    for h in range(HEADS):
        for g in range(GROUP):
            q = queries[h * GROUP + g].double()
            logits = q @ keys[h].double().T / math.sqrt(DIM)
            visible = k_pos[h][None, :] <= q_pos[:, None]
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            rows[h] += probs / GROUP
    return rows


def build(seed: int, padded: bool) -> tuple[CompactionInputs, torch.Tensor, torch.Tensor]:
    """Candidates (prefill-like, or decode-like with per-head positions and padding)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(HEADS, LENGTH, DIM, generator=gen)
    keys[:, 5] = keys[:, 3] * 2.0  # near-duplicates (cosine 1) for the redundancy term
    keys[:, 20] = keys[:, 3] + 0.01
    queries = torch.randn(HEADS * GROUP, WINDOW, DIM, generator=gen)
    if padded:
        valid = torch.ones(HEADS, LENGTH, dtype=torch.bool)
        valid[1, -7:] = False
        positions = torch.stack(
            [torch.arange(LENGTH) * 2 + 3, torch.arange(LENGTH) * 2 + 1]
        ).masked_fill(~valid, -1)
        keys = keys.masked_fill(~valid[..., None], 0.0)
    else:
        valid = torch.ones(HEADS, LENGTH, dtype=torch.bool)
        positions = torch.arange(LENGTH).expand(HEADS, -1)
    # the window queries are the tokens of the most recent valid candidates of head 0
    last = int(positions[0].max())
    q_pos = torch.arange(last - WINDOW + 1, last + 1)
    k_pos = positions.masked_fill(~valid, 10**9)
    rows = attention_rows(queries, keys, q_pos, k_pos)
    observed = LayerObservation(
        keys=keys, window_scores=rows.sum(dim=1).float(), window_attention=rows.float()
    )
    inputs = CompactionInputs(
        num_candidates=LENGTH,
        num_kv_heads=HEADS,
        layers=[observed],
        positions=positions if padded else None,
        valid=valid if padded else None,
    )
    return inputs, rows, valid


def recent(positions: torch.Tensor, valid: torch.Tensor, count: int) -> torch.Tensor:
    """``(T,)`` bool: the ``count`` most recent valid candidates of one head."""
    order = positions.masked_fill(~valid, -(10**9)).argsort(descending=True)
    mask = torch.zeros_like(valid)
    mask[order[:count]] = True
    return mask & valid


def top_k(scores: torch.Tensor, valid: torch.Tensor, k: int) -> list[int]:
    masked = scores.masked_fill(~valid, float("-inf"))
    return sorted(masked.argsort(descending=True, stable=True)[:k].tolist())


def reference_rkv_scores(
    rows: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, p: RKV
) -> torch.Tensor:
    out = torch.zeros(HEADS, LENGTH, dtype=torch.float64)
    for h in range(HEADS):
        v = valid[h]
        window = recent(positions[h], v, p.window_size)
        importance = rows[h, -p.window_size :].mean(dim=0).masked_fill(window | ~v, 0.0)
        pad = p.kernel_size // 2
        importance = F.max_pool1d(importance[None, None], p.kernel_size, 1, pad)[0, 0]
        idx = [i for i in range(LENGTH) if v[i]]
        unit = {i: keys[h, i].double() / keys[h, i].double().norm() for i in idx}
        sim = torch.zeros(LENGTH, LENGTH, dtype=torch.float64)
        for i in idx:
            for j in idx:
                if i != j:
                    sim[i, j] = unit[i] @ unit[j]
        for i in idx:
            similar = [j for j in idx if sim[i, j] > p.similarity_threshold]
            if similar:
                latest = max(similar, key=lambda j: int(positions[h, j]))
                sim[i, latest] = 0.0
        mean = torch.tensor([sum(float(sim[i, j]) for i in idx) / len(idx) for j in range(LENGTH)])
        redundancy = torch.softmax(mean.double().masked_fill(~v, float("-inf")), dim=-1)
        score = p.mix_lambda * importance - (1 - p.mix_lambda) * redundancy
        out[h] = score.masked_fill(window, float("inf"))
    return out


@pytest.mark.parametrize("padded", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rkv_matches_its_reference(seed: int, padded: bool) -> None:
    inputs, rows, valid = build(seed, padded)
    policy = make_policy("rkv", budget=12, window_size=4, kernel_size=3)
    assert isinstance(policy, RKV)
    positions = inputs.positions_or_arange()
    keys = inputs.layers[0].keys
    assert keys is not None
    expected = reference_rkv_scores(rows.float().double(), keys, positions, valid, policy)
    got = policy.score(inputs, 0)
    finite = torch.isfinite(expected) & valid
    assert torch.equal(torch.isinf(got) & valid, torch.isinf(expected) & valid)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-6, atol=1e-9)
    plan = policy.plan(inputs)
    for h in range(HEADS):
        assert plan.kept[0][h].tolist() == top_k(expected[h], valid[h], 12)


def test_rkv_redundancy_drops_the_older_duplicates() -> None:
    """Orthogonal keys, except that 3, 5 and 9 point the same way: with no importance
    (lambda 0) the older copies are the most redundant and go first; the latest stays."""
    length = 12
    keys = torch.eye(DIM)[:length].expand(HEADS, -1, -1).clone()
    keys[:, 5] = keys[:, 3] * 2.0
    keys[:, 9] = keys[:, 3] * 0.5
    observed = LayerObservation(
        keys=keys, window_attention=torch.zeros(HEADS, 2, length, dtype=torch.float32)
    )
    inputs = CompactionInputs(num_candidates=length, num_kv_heads=HEADS, layers=[observed])
    policy = make_policy("rkv", budget=length - 2, window_size=2, mix_lambda=0.0)
    plan = policy.plan(inputs)
    for h in range(HEADS):
        assert set(range(length)) - set(plan.kept[0][h].tolist()) == {3, 5}


@pytest.mark.parametrize("padded", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoding_snapkv_matches_its_reference(seed: int, padded: bool) -> None:
    inputs, rows, valid = build(seed, padded)
    policy = make_policy("decoding_snapkv", budget=12, window_size=4, kernel_size=5)
    positions = inputs.positions_or_arange()
    for h in range(HEADS):
        window = recent(positions[h], valid[h], 4)
        mass = rows[h].sum(dim=0).float().double().masked_fill(window | ~valid[h], 0.0)
        pooled = F.max_pool1d(mass[None, None], 5, 1, 2)[0, 0]
        tie = mass / mass.abs().max() * 1e-9
        expected = (pooled + tie).masked_fill(window, float("inf"))
        assert policy.plan(inputs).kept[0][h].tolist() == top_k(expected, valid[h], 12)


def test_decode_policies_are_registered_for_both_phases() -> None:
    from lmcompact.policies import Phase, available_policies, get_policy_class

    for name in ("decoding_snapkv", "rkv"):
        assert name in available_policies()
        assert get_policy_class(name).phases == Phase.BOTH


@pytest.mark.parametrize(
    "bad",
    [{"mix_lambda": 1.5}, {"kernel_size": 4}, {"window_size": 0}, {"interval": 0}],
)
def test_rkv_refuses_bad_parameters(bad: dict) -> None:
    with pytest.raises(ValueError):
        make_policy("rkv", **bad)
