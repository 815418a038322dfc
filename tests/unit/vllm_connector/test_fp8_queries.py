"""Captured window queries on fp8 engines are read as numbers."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from connectors.vllm.patches.engine import query_numbers


def test_fp8_queries_are_read_as_numbers() -> None:
    """vLLM 0.26's FlashAttention 3 gets fp8 queries (``fp8(q / q_scale)``) with an fp8
    cache; the captured window reads them back, per tensor or per KV head's query group."""
    q = torch.tensor([[[1.0, -2.0], [0.5, 4.0]], [[3.0, 1.0], [-1.0, 0.25]]])  # (2, 2, 2)
    raw = q.to(torch.float8_e4m3fn)
    per_tensor = SimpleNamespace(_q_scale=torch.tensor([0.5]))
    assert torch.equal(query_numbers(per_tensor, raw, torch.float32), q * 0.5)
    per_group = SimpleNamespace(_q_scale=torch.tensor([2.0, 0.25]))  # 2 KV heads, 1 q head each
    want = q * torch.tensor([2.0, 0.25])[None, :, None]
    assert torch.equal(query_numbers(per_group, raw, torch.float32), want)
    assert query_numbers(per_tensor, q, torch.float32) is q  # unquantized: untouched
