"""Gemma-3-270m (15 of 18 layers slide over 512 tokens) through lmcompact attention:
logits of a 700-token prompt and of forced decode steps equal transformers' SDPA, with a
plain cache and with a compacted cache that keeps every token (its ragged decode path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration


@torch.no_grad()
def test_gemma3_long_prompt_matches_sdpa(gemma3_path: Path) -> None:
    from transformers import AutoModelForCausalLM, DynamicCache

    from lmcompact.hf.attention import enable_lmcompact_attention
    from lmcompact.hf.cache import CompactingCache

    model = AutoModelForCausalLM.from_pretrained(
        str(gemma3_path), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    torch.manual_seed(0)
    prompt = torch.randint(100, 20000, (1, 700))
    steps = torch.randint(100, 20000, (4,))

    def run(cache: object) -> torch.Tensor:
        rows = [model(prompt, past_key_values=cache).logits[0, -1]]
        for token in steps:
            rows.append(model(token.view(1, 1), past_key_values=cache).logits[0, -1])
        return torch.stack(rows)

    expected = run(DynamicCache(config=model.config))
    enable_lmcompact_attention(model)
    plain = run(DynamicCache(config=model.config))
    cache = CompactingCache(model, "streaming_llm", budget=1.0)
    compacted = run(cache)
    assert cache.is_compacted
    # before the window was masked, these differed by 11 (prompt longer than the window)
    assert (plain - expected).abs().max().item() < 1e-3
    assert (compacted - expected).abs().max().item() < 1e-3
