"""lmcompact attention on sliding-window layers matches transformers' own masks.

A small random Gemma-3 (sliding window 8, two of three layers sliding) run with
transformers' SDPA is the reference; the real Gemma-3-270m has its counterpart in
tests/integration/hf/test_gemma3_sliding_attention.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

from lmcompact.hf.attention import enable_lmcompact_attention
from lmcompact.hf.cache import CompactingCache
from lmcompact.hf.paged import PagedCache

WINDOW = 8


def small_gemma() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return Gemma3ForCausalLM(config).eval()


@torch.no_grad()
def reference_steps(model: Gemma3ForCausalLM, prompt: torch.Tensor, steps: torch.Tensor):
    """Logits of the prompt's last token and of each forced step, transformers' SDPA."""
    cache = DynamicCache(config=model.config)
    out = [model(prompt, past_key_values=cache).logits[0, -1]]
    for token in steps:
        out.append(model(token.view(1, 1), past_key_values=cache).logits[0, -1])
    return torch.stack(out)


def test_prefill_with_a_plain_cache_masks_the_window() -> None:
    model = small_gemma()
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        expected = model(ids).logits
        enable_lmcompact_attention(model)
        got = model(ids).logits
    assert (got - expected).abs().max().item() < 1e-5


def test_compacted_decode_sees_only_the_window() -> None:
    """Keeping every token (budget 1.0) the compacted cache is the full cache; its ragged
    decode must still hide keys more than the window behind each query."""
    model = small_gemma()
    prompt = torch.randint(0, 256, (1, 40))
    steps = torch.randint(0, 256, (6,))
    expected = reference_steps(model, prompt, steps)
    enable_lmcompact_attention(model)
    cache = CompactingCache(model, "streaming_llm", budget=1.0)
    with torch.no_grad():
        got = [model(prompt, past_key_values=cache).logits[0, -1]]
        assert cache.is_compacted
        for token in steps:
            got.append(model(token.view(1, 1), past_key_values=cache).logits[0, -1])
    assert (torch.stack(got) - expected).abs().max().item() < 1e-4


def held_positions(cache: CompactingCache, layer: int) -> list[torch.Tensor]:
    """Per kv head, the original positions a compacted layer holds (batch row 0)."""
    ragged = cache.layers[layer].ragged
    assert ragged is not None
    _, _, positions, valid = ragged.padded()
    return [positions[0, h][valid[0, h]] for h in range(positions.shape[1])]


def test_prefill_drops_the_keys_sliding_layers_have_passed() -> None:
    """Budget 1.0: a sliding layer holds only the W - 1 keys the next query can still see,
    the full layer the whole prompt, and the logits stay the full cache's."""
    model = small_gemma()
    prompt = torch.randint(0, 256, (1, 40))
    enable_lmcompact_attention(model)
    cache = CompactingCache(model, "snapkv", budget=1.0)
    with torch.no_grad():
        model(prompt, past_key_values=cache)
    for layer in (0, 1):
        for held in held_positions(cache, layer):
            assert held.tolist() == list(range(40 - WINDOW + 1, 40))
    assert all(held.numel() == 40 for held in held_positions(cache, 2))


@pytest.mark.parametrize("policy", ["rkv", "decoding_snapkv", "streaming_llm"])
def test_decode_replans_never_keep_keys_outside_the_window(policy: str) -> None:
    """A decode budget above the window: every re-plan leaves a sliding layer only keys its
    next query sees (the redundancy or sink terms would otherwise keep passed ones), and
    with the full layer under budget too the logits are the full cache's."""
    model = small_gemma()
    prompt = torch.randint(0, 256, (1, 20))
    steps = torch.randint(0, 256, (30,))
    expected = reference_steps(model, prompt, steps)
    enable_lmcompact_attention(model)
    cache = CompactingCache(model, policy, budget=1.0, decode_budget=64, decode_slack=4)
    got = []
    with torch.no_grad():
        got.append(model(prompt, past_key_values=cache).logits[0, -1])
        for token in steps:
            got.append(model(token.view(1, 1), past_key_values=cache).logits[0, -1])
            for layer in (0, 1):
                first = cache.layers[layer].first_visible()
                assert first is not None
                for held in held_positions(cache, layer):
                    # re-planned once slack tokens more than the window are held
                    assert int(held.min()) >= first - 1 - cache.decode_slack
                    assert held.numel() <= WINDOW + cache.decode_slack
    assert cache.stats["decode_compactions"] > 0
    assert (torch.stack(got) - expected).abs().max().item() < 1e-4


def test_paged_cache_refuses_sliding_layers() -> None:
    model = small_gemma()
    with pytest.raises(ValueError, match="sliding-window"):
        PagedCache(model.config, num_blocks=16, block_size=8)
