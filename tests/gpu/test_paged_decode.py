"""The fixed-grid decode kernel (float and int8 pools) on CUDA, also replayed in a CUDA graph.

Against :func:`paged_attention_reference` on poisoned synthetic pools (a read of
any slot outside a head's visible range gives NaN). The graph test captures one
launch, then grows every request by one token in the device buffers and
replays: the kernel must split the new lengths itself.
"""

from __future__ import annotations

import pytest
import torch

from lmcompact.kernels.paged_attention import paged_decode_attention
from lmcompact.kernels.reference_paged import paged_attention_reference
from lmcompact.kernels.synthetic import PagedCase, random_paged_case
from lmcompact.layout.paged import PagedLengths
from tests.gpu.errors import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def int8_pool(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(block, slot, head) int8 values and float32 scales of a ``(nb, bs, Hkv, D)`` pool."""
    x = pool.float().nan_to_num(0.0)
    scale = x.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    return torch.round(x / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


def case(dtype: torch.dtype, head_dim: int, seed: int = 0) -> PagedCase:
    kept = [[5, 0, 64, 1], [128, 7, 3, 30], [0, 0, 0, 0]]
    return random_paged_case(
        kept,
        [128, 128, 0],
        [300, 9, 1000],
        [1, 1, 1],
        group=4,
        head_dim=head_dim,
        block_size=64,
        dtype=dtype,
        device="cuda",
        seed=seed,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_kernel_matches_reference(dtype: torch.dtype, head_dim: int, splits: int) -> None:
    c = case(dtype, head_dim)
    args = (c.queries, c.key_pool, c.value_pool, c.block_table, c.cu_seqlens_q, c.lengths)
    want, _ = paged_attention_reference(*args, scale=head_dim**-0.5)
    got = paged_decode_attention(*args, scale=head_dim**-0.5, num_splits=splits)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_int8_decode_kernel_matches_dequantized_reference(
    dtype: torch.dtype, head_dim: int
) -> None:
    c = case(dtype, head_dim, seed=1)
    qk, sk = int8_pool(c.key_pool)
    qv, sv = int8_pool(c.value_pool)
    common = (c.queries, qk, qv, c.block_table, c.cu_seqlens_q, c.lengths)
    want, _ = paged_attention_reference(
        *common, scale=head_dim**-0.5, key_scales=sk, value_scales=sv
    )
    got = paged_decode_attention(
        *common, scale=head_dim**-0.5, num_splits=4, key_scales=sk, value_scales=sv
    )
    assert rel_err(got, want) < TOL[dtype]
    float_out, _ = paged_attention_reference(
        c.queries,
        c.key_pool,
        c.value_pool,
        c.block_table,
        c.cu_seqlens_q,
        c.lengths,
        scale=head_dim**-0.5,
    )
    assert rel_err(got, float_out) < 5e-2  # int8 K/V stays near the float pool


def test_decode_kernel_replays_in_a_cuda_graph_at_new_lengths() -> None:
    c = case(torch.bfloat16, 64, seed=2)
    lengths = PagedLengths(
        c.lengths.kept.clone(), c.lengths.tail_start.clone(), c.lengths.seq_len.clone()
    )
    args = (c.queries, c.key_pool, c.value_pool, c.block_table, c.cu_seqlens_q, lengths)
    shorter = lengths.seq_len - 1
    lengths.seq_len.copy_(shorter)
    paged_decode_attention(*args, scale=0.125, num_splits=4)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(*args, scale=0.125, num_splits=4)
    lengths.seq_len.copy_(shorter + 1)  # every request one token longer, on the device only
    graph.replay()
    want, _ = paged_attention_reference(*args, scale=0.125)
    assert rel_err(out, want) < TOL[torch.bfloat16]
