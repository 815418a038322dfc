"""Known answers and bad input for the query-agnostic policies (kvzip, expected_attention)."""

from __future__ import annotations

import math

import pytest
import torch

from lmcompact.attention.rope import Rope
from lmcompact.attention.scores import context_scores
from lmcompact.policies import CompactionInputs, LayerObservation, make_policy
from lmcompact.policies.expected_attention import ExpectedAttention
from lmcompact.policies.kvzip import sample_query_positions
from tests.unit.policies.cases import synthetic_inputs

NEEDLE = 17


# ------------------------------------------------------------------ kvzip
def test_sampled_positions_cover_the_prompt_and_keep_the_window() -> None:
    assert sample_query_positions(10, 16, 4).tolist() == list(range(10))
    positions = sample_query_positions(100, 20, 4)
    assert positions.numel() == 20
    assert positions[-4:].tolist() == [96, 97, 98, 99]
    assert positions[:-4].tolist() == list(range(5, 96, 6))  # stride ceil(96 / 16) = 6
    assert sample_query_positions(100, 4, 4).tolist() == [96, 97, 98, 99]


def test_kvzip_keeps_a_key_one_query_reads_sharply() -> None:
    """Near-uniform attention everywhere except one query, far after the needle, that
    reads the needle key; the max over queries keeps it, a sum over queries does not."""
    generator = torch.Generator().manual_seed(0)
    t, d = 64, 16
    keys = torch.randn(1, 1, t, d, generator=generator) * 0.05
    queries = torch.randn(1, 2, t, d, generator=generator) * 0.05
    queries[0, 1, 50] = keys[0, 0, NEEDLE] / keys[0, 0, NEEDLE].norm() * 40.0
    keys[0, 0, NEEDLE] = keys[0, 0, NEEDLE] / keys[0, 0, NEEDLE].norm()
    positions = torch.arange(t)
    scores = context_scores(queries, keys, positions)[0]
    inputs = CompactionInputs(t, 1, [LayerObservation(context_scores=scores)])
    plan = make_policy("kvzip", budget=4, n_sink=2).plan(inputs)
    kept = plan.kept[0][0].tolist()
    assert kept[:2] == [0, 1] and NEEDLE in kept
    # control: by total mass (H2O's sum) the needle is not among the top 4
    total = torch.softmax(
        (queries[0] @ keys[0, 0].T / math.sqrt(d)).masked_fill(
            positions.view(1, -1) > positions.view(-1, 1), float("-inf")
        ),
        dim=-1,
    ).sum(dim=(0, 1))
    assert NEEDLE not in torch.topk(total, 4).indices.tolist()


def test_context_scores_match_the_full_attention_matrix() -> None:
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(2, 6, 30, 8, generator=generator)
    keys = torch.randn(2, 2, 30, 8, generator=generator)
    positions = torch.tensor([29, 3, 0, 17, 18, 25, 8])
    got = context_scores(queries[:, :, positions], keys, positions, query_chunk=3)
    logits = queries @ keys.repeat_interleave(3, dim=1).transpose(-1, -2) / math.sqrt(8)
    causal = torch.arange(30).view(1, -1) > torch.arange(30).view(-1, 1)
    weights = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)
    expected = weights[:, :, positions].view(2, 2, 3, 7, 30).amax(dim=(2, 3))
    torch.testing.assert_close(got, expected)
    assert float(got[..., 26:].max()) > 0 and float(got[..., 30 - 1].min()) > 0


# ------------------------------------------------------- expected attention
def _gaussian_window(
    mean: torch.Tensor, spread: torch.Tensor, w: int, seed: int = 0
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(w, mean.numel(), generator=generator)
    return mean + noise * spread


def test_expected_attention_keeps_the_key_aligned_with_the_mean_query() -> None:
    d, t, w = 8, 40, 16
    direction = torch.nn.functional.normalize(torch.ones(d), dim=0)
    window = _gaussian_window(direction * 4.0, torch.full((d,), 0.1), w)
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(1, t, d, generator=generator) * 0.3
    keys[0, NEEDLE] = direction * 3.0
    values = torch.ones(1, t, d)
    inputs = CompactionInputs(
        t,
        1,
        [LayerObservation(keys=keys, values=values, window_queries=window.unsqueeze(0))],
        query_positions=torch.arange(t, t + w),
    )
    plan = make_policy("expected_attention", budget=3, n_sink=1).plan(inputs)
    assert plan.kept[0][0].tolist()[0] == 0 and NEEDLE in plan.kept[0][0].tolist()


def test_expected_attention_covariance_term_keeps_a_key_along_the_spread() -> None:
    """Zero-mean queries that vary along one axis: only the k^T Sigma k term sees it."""
    d, t, w = 8, 40, 64
    spread = torch.full((d,), 0.05)
    spread[2] = 3.0
    half = _gaussian_window(torch.zeros(d), spread, w // 2, seed=4)
    window = torch.cat([half, -half])  # mean exactly zero
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(1, t, d, generator=generator) * 0.5
    keys[0, :, 2] = 0.0
    keys[0, NEEDLE] = torch.zeros(d)
    keys[0, NEEDLE, 2] = 2.0
    layer = LayerObservation(keys=keys, values=torch.ones(1, t, d), window_queries=window[None])
    inputs = CompactionInputs(t, 1, [layer], query_positions=torch.arange(t, t + w))
    with_cov = make_policy("expected_attention", budget=2, n_sink=0).plan(inputs)
    assert NEEDLE in with_cov.kept[0][0].tolist()
    without = make_policy("expected_attention", budget=2, n_sink=0, use_covariance=False)
    assert NEEDLE not in without.plan(inputs).kept[0][0].tolist()


def test_expected_attention_rotates_statistics_to_future_positions() -> None:
    """The rotated mean equals the mean over future distances of each query rotated
    forward from its own position (R(p + d) = R(d) R(p))."""
    d, w, n_future = 8, 6, 5
    rope = Rope.from_theta(100.0, d)
    generator = torch.Generator().manual_seed(6)
    post = torch.randn(2, w, d, generator=generator, dtype=torch.float64)
    positions = torch.arange(20, 20 + w)
    inputs = CompactionInputs(4, 1, [LayerObservation()], query_positions=positions, rope=rope)
    policy = ExpectedAttention(n_future_positions=n_future)
    mu, cov = policy.query_statistics(post, inputs)
    future = torch.arange(26, 26 + n_future, dtype=torch.float64)
    forward = torch.stack(
        [rope.rotate(post, (f - positions).double()) for f in future]
    )  # (F, Hq, W, D)
    torch.testing.assert_close(mu, forward.mean(dim=(0, 2)))
    assert cov is not None and cov.shape == (2, d, d)
    torch.testing.assert_close(cov, cov.transpose(1, 2))
    # without RoPE facts: plain statistics of the post-RoPE queries
    plain, _ = policy.query_statistics(
        post, CompactionInputs(4, 1, [LayerObservation()], query_positions=positions)
    )
    torch.testing.assert_close(plain, post.mean(dim=1))


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("kvzip", {"n_sink": -1}, r"n_sink must be >= 0, got -1"),
        ("kvzip", {"window": -2}, r"window must be >= 0, got -2"),
        ("kvzip", {"kernel_size": 4}, r"kernel_size must be an odd integer >= 1, got 4"),
        ("kvzip", {"window": 64, "max_queries": 32}, r"max_queries must be >= max\(1, window=64\)"),
        ("expected_attention", {"n_future_positions": 0}, r"n_future_positions must be >= 1"),
        ("expected_attention", {"epsilon": -1.0}, r"epsilon must be >= 0, got -1.0"),
        ("expected_attention", {"n_sink": -3}, r"n_sink must be >= 0, got -3"),
        ("expected_attention", {"tau": 1}, r"bad parameters for policy 'expected_attention'"),
    ],
)
def test_bad_hyper_parameters(name: str, params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy(name, **params)


@pytest.mark.parametrize(
    ("name", "drop", "message"),
    [
        ("kvzip", "context_scores", r"policy 'kvzip' needs context_scores .* CONTEXT_SCORES"),
        ("expected_attention", "window_queries", r"'expected_attention' needs window_queries"),
        ("expected_attention", "keys", r"'expected_attention' needs keys"),
    ],
)
def test_missing_inputs(name: str, drop: str, message: str) -> None:
    inputs = synthetic_inputs(2, 2, 16, 4)
    setattr(inputs.layers[1], drop, None)
    with pytest.raises(ValueError, match=message):
        make_policy(name).plan(inputs)


def test_bad_window_queries() -> None:
    policy = make_policy("expected_attention")
    inputs = synthetic_inputs(1, 2, 16, 4)
    inputs.layers[0].window_queries = torch.rand(3, 4, 4)  # 3 query heads for 2 kv heads
    with pytest.raises(ValueError, match=r"q_heads a multiple of kv_heads=2"):
        policy.plan(inputs)
    inputs = synthetic_inputs(1, 2, 16, 4)
    inputs.layers[0].window_queries = torch.rand(4, 4, 5)
    with pytest.raises(ValueError, match=r"window_queries head_dim 5 differs from the keys' 4"):
        policy.plan(inputs)
    inputs = synthetic_inputs(1, 2, 16, 4)
    inputs.query_positions = None
    with pytest.raises(ValueError, match=r"need query_positions of shape \(4,\), got None"):
        policy.plan(inputs)


def test_bad_context_scores_and_positions() -> None:
    inputs = synthetic_inputs(1, 2, 16, 4)
    inputs.layers[0].context_scores = torch.rand(2, 15)
    with pytest.raises(ValueError, match=r"context_scores has shape \(2, 15\)"):
        make_policy("kvzip").plan(inputs)
    with pytest.raises(ValueError, match=r"query_positions must have shape \(3,\)"):
        context_scores(torch.rand(1, 2, 3, 4), torch.rand(1, 1, 8, 4), torch.arange(4))
    with pytest.raises(ValueError, match=r"query positions must lie in \[0, 8\)"):
        context_scores(torch.rand(1, 2, 2, 4), torch.rand(1, 1, 8, 4), torch.tensor([1, 8]))
    with pytest.raises(ValueError, match="length must be > 0"):
        sample_query_positions(0, 4, 2)


def test_shifted_context_scores_are_a_repeat_after_the_context() -> None:
    """With shift, every query (moved by RoPE) sees every key, as a repeat of the context
    placed after it would: equal to full attention of the moved queries, no mask."""
    generator = torch.Generator().manual_seed(2)
    rope = Rope.from_theta(10_000.0, 8)
    pre_q = torch.randn(1, 4, 12, 8, generator=generator)
    pre_k = torch.randn(1, 2, 12, 8, generator=generator)
    positions = torch.arange(12)
    queries, keys = rope.rotate(pre_q, positions), rope.rotate(pre_k, positions)
    got = context_scores(queries, keys, positions, shift=12, rope=rope)
    moved = rope.rotate(pre_q, positions + 12)  # the same tokens at positions 12..23
    logits = moved @ keys.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(8)
    expected = torch.softmax(logits, dim=-1).view(1, 2, 2, 12, 12).amax(dim=(2, 3))
    torch.testing.assert_close(got, expected)
    assert float(got[..., -1].min()) > 0  # the last key is seen by every query now
    with pytest.raises(ValueError, match="needs rope="):
        context_scores(queries, keys, positions, shift=12)
    assert make_policy("kvzip").context_shift(100) == 100
    assert make_policy("kvzip", repeat=False).context_shift(100) is None
