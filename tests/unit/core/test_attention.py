"""Window scores and reference ragged attention against dense oracles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcompact.attention import (
    cumulative_scores,
    dense_attention,
    ragged_attention,
    window_scores,
    window_scores_naive,
)
from lmcompact.layout import RaggedKV
from lmcompact.plan import KeepPlan

shapes = st.tuples(
    st.integers(1, 2),  # batch
    st.integers(1, 3),  # kv heads
    st.sampled_from([1, 3, 8]),  # GQA ratio
    st.integers(1, 40),  # T
    st.sampled_from([4, 16]),  # head_dim
)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_keep_all_ragged_equals_dense(shape: tuple[int, int, int, int, int], seed: int) -> None:
    b, hkv, ratio, t, d = shape
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    s = min(t, 5)
    queries = torch.randn(b, hkv * ratio, s, d, generator=g)
    q_pos = torch.arange(t - s, t).expand(b, s)
    kv = RaggedKV.from_dense([keys], [values], [KeepPlan.full(1, hkv, t)] * b)
    out, _ = ragged_attention(queries, kv.layers[0], q_pos)
    expected = dense_attention(queries, keys, values, q_pos, torch.arange(t).expand(b, t))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_decode_tokens_attend_to_kept_plus_new_only() -> None:
    g = torch.Generator().manual_seed(1)
    b, hkv, ratio, t, d = 1, 2, 3, 12, 8
    keys, values = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    kept = [[0, 1, 7, 11], [3, 4, 5]]
    layer = RaggedKV.from_dense([keys], [values], [KeepPlan.from_lists(t, [kept])]).layers[0]
    new_k, new_v = torch.randn(b, hkv, 2, d, generator=g), torch.randn(b, hkv, 2, d, generator=g)
    layer = layer.append(new_k, new_v, torch.tensor([[t, t + 1]]))
    queries = torch.randn(b, hkv * ratio, 2, d, generator=g)
    out, mass = ragged_attention(queries, layer, torch.tensor([[t, t + 1]]), return_key_mass=True)
    for h, positions in enumerate(kept):
        k = torch.cat([keys[0, h, positions], new_k[0, h]])[None, None]
        v = torch.cat([values[0, h, positions], new_v[0, h]])[None, None]
        key_pos = torch.tensor([[*positions, t, t + 1]])
        q = queries[:, h * ratio : (h + 1) * ratio]
        expected = dense_attention(q, k, v, torch.tensor([[t, t + 1]]), key_pos)
        torch.testing.assert_close(out[:, h * ratio : (h + 1) * ratio], expected, atol=1e-5, rtol=0)
    # token t+1 is invisible to the query at position t; each query's mass sums to 1
    assert mass is not None
    assert mass.sum().item() == pytest.approx(2 * hkv, abs=1e-4)


@settings(max_examples=25, deadline=None)
@given(shape=shapes, w=st.integers(1, 8), chunk=st.integers(1, 16), seed=st.integers(0, 999))
def test_window_scores_match_full_matrix(
    shape: tuple[int, int, int, int, int], w: int, chunk: int, seed: int
) -> None:
    b, hkv, ratio, t, d = shape
    w = min(w, t)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, t, d, generator=g)
    queries = torch.randn(b, hkv * ratio, w, d, generator=g)
    mass, attention = window_scores(queries, keys, chunk_size=chunk, return_attention=True)
    torch.testing.assert_close(mass, window_scores_naive(queries, keys), atol=1e-5, rtol=1e-5)
    assert attention is not None
    torch.testing.assert_close(attention.sum(dim=2), mass, atol=1e-5, rtol=1e-5)
    # every window query distributes exactly 1 unit of attention
    torch.testing.assert_close(mass.sum(-1), torch.full((b, hkv), float(w)), atol=1e-4, rtol=0)


def test_cumulative_scores_cover_all_queries() -> None:
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 30, 8, generator=g)
    queries = torch.randn(1, 6, 30, 8, generator=g)
    total = cumulative_scores(queries, keys, query_chunk=7, key_chunk=9)
    torch.testing.assert_close(total, window_scores_naive(queries, keys), atol=1e-4, rtol=1e-5)
    # the first key is seen by all 30 queries, the last only by itself
    assert total[0, :, 0].min() > total[0, :, -1].max()


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "match"),
    [
        ((1, 4, 2, 8), (1, 3, 5, 8), "multiple of kv_heads"),
        ((1, 4, 2, 8), (1, 2, 5, 16), "differ in batch or head_dim"),
        ((4, 2, 8), (1, 2, 5, 8), "queries must be"),
    ],
)
def test_window_scores_bad_shapes(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        window_scores(torch.zeros(q_shape), torch.zeros(k_shape))


def test_ragged_attention_bad_query_shape() -> None:
    keys = torch.zeros(1, 2, 4, 8)
    layer = RaggedKV.from_dense([keys], [keys], [KeepPlan.full(1, 2, 4)]).layers[0]
    with pytest.raises(ValueError, match="do not fit the layer"):
        ragged_attention(torch.zeros(1, 3, 1, 8), layer, torch.zeros(1, 1, dtype=torch.int64))
