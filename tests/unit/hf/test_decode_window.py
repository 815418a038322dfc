"""The decode window's attention rows over a ragged cache, against a per-head loop."""

from __future__ import annotations

import math

import torch

from lmcompact.hf.cache_plans import decode_window_attention


def test_rows_match_a_loop_over_heads_and_queries() -> None:
    gen = torch.Generator().manual_seed(3)
    b, h, g, w, length, d = 2, 2, 3, 4, 10, 8
    queries = torch.randn(b, h * g, w, d, generator=gen)
    keys = torch.randn(b, h, length, d, generator=gen)
    positions = torch.randint(0, 30, (b, h, length), generator=gen).sort(dim=-1).values
    valid = torch.rand(b, h, length, generator=gen) > 0.2
    q_pos = torch.tensor([14, 18, 22, 26])
    rows = decode_window_attention(queries, q_pos, keys, positions, valid, scale=0.3)
    assert rows.shape == (b, h, w, length)
    for bi in range(b):
        for hi in range(h):
            for wi in range(w):
                seen = valid[bi, hi] & (positions[bi, hi] <= q_pos[wi])
                expected = torch.zeros(length, dtype=torch.float64)
                for gi in range(g):
                    q = queries[bi, hi * g + gi, wi].double()
                    logits = [
                        float(q @ keys[bi, hi, j].double()) * 0.3 if seen[j] else -math.inf
                        for j in range(length)
                    ]
                    if seen.any():
                        expected += torch.softmax(torch.tensor(logits), dim=0) / g
                torch.testing.assert_close(
                    rows[bi, hi, wi].double(), expected, rtol=1e-5, atol=1e-6
                )
