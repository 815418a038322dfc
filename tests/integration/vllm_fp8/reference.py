"""A transformers reference that reads K/V as vLLM's CPU fp8 cache stores them.

vLLM's CPU cache kernel stores ``fp8(x / scale)`` rounded toward zero (checked bit for bit
against the kernel in ``test_fp8_kernel.py``), and every attention, prefill included, reads
K/V back from the cache. This reference quantizes the post-RoPE keys and the values of
every attention call the same way, then runs the masked per-(layer, head) reference of
:mod:`tests.integration.vllm_sliding.reference` (kept tokens of a compacted span).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.integration.vllm_sliding import reference

IMPLEMENTATION = "lmcompact_fp8_cache_reference"


def truncate_fp8(x: torch.Tensor, element: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as vLLM's CPU kernel stores and reads it: fp8 of ``x / scale`` rounded toward
    zero, times ``scale``, in float32."""
    y = x.float() / scale
    raw = y.to(element).view(torch.uint8)
    over = raw.view(element).float().abs() > y.abs()  # torch rounds to nearest: step back
    raw = torch.where(over, raw - 1, raw)
    return raw.view(element).float() * scale


def load(model_dir: str, element: torch.dtype = torch.float8_e4m3fn) -> Any:
    """The model in float32 whose attention reads fp8-stored K/V (scales 1.0), masked by
    :func:`tests.integration.vllm_sliding.reference.compacted`."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *args: Any,
        **kw: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = truncate_fp8(key, element).to(query.dtype)
        value = truncate_fp8(value, element).to(query.dtype)
        return reference._attention(module, query, key, value, *args, **kw)

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=IMPLEMENTATION
    ).eval()
