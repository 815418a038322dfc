"""Decode policies in the transformers CompactingCache on the real SmolLM2.

``decoding_snapkv`` and ``rkv`` re-plan every ``interval`` generated tokens from the
attention of the last ``window_size`` decode queries (kept by each layer), so no head ever
holds more than its post-prefill size plus ``interval - 1``; a custom decode policy is a
plain ``ScorePolicy`` subclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcompact.eval.text import text_stream
from lmcompact.policies import CompactionInputs, Need, Phase, ScorePolicy

pytestmark = pytest.mark.integration

PROMPT_TOKENS = 256
NEW_TOKENS = 40
INTERVAL = 8


@pytest.fixture(scope="module")
def loaded(smollm2_path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcompact.hf.attention import enable_lmcompact_attention

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    return enable_lmcompact_attention(model), tokenizer


@pytest.fixture(scope="module")
def prompt(loaded: tuple[Any, Any]) -> torch.Tensor:
    _, tokenizer = loaded
    ids = tokenizer(text_stream(3), add_special_tokens=False)["input_ids"][:PROMPT_TOKENS]
    return torch.tensor([ids])


def generate(loaded: tuple[Any, Any], prompt: torch.Tensor, cache: Any) -> list[int]:
    model, tokenizer = loaded
    with torch.no_grad():
        out = model.generate(
            prompt,
            past_key_values=cache,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    return out[0, prompt.shape[1] :].tolist()


@dataclass
class OldestFirst(ScorePolicy):
    """A custom decode policy: keeps the most recent tokens (scores = positions)."""

    name = "test_oldest_first"
    needs = Need.NOTHING
    phases = Phase.BOTH
    interval: int = INTERVAL

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        return inputs.positions_or_arange().double()


@pytest.mark.parametrize(
    "policy", ["decoding_snapkv", "rkv", "custom"], ids=["decoding_snapkv", "rkv", "custom"]
)
def test_decode_policy_recompacts_every_interval(
    policy: str, loaded: tuple[Any, Any], prompt: torch.Tensor
) -> None:
    from lmcompact.hf.cache import CompactingCache

    model, _ = loaded
    if policy == "custom":
        cache = CompactingCache(model, OldestFirst(budget=0.25))
    else:
        cache = CompactingCache(model, policy, budget=0.25, interval=INTERVAL)
    assert cache.decode_slack == INTERVAL - 1
    lengths: list[int] = []
    original = cache.after_decode_step

    def watched() -> None:
        original()
        lengths.append(int(cache.layers[0].ragged.lengths().max()))

    cache.after_decode_step = watched  # type: ignore[method-assign]
    tokens = generate(loaded, prompt, cache)
    assert len(tokens) == NEW_TOKENS
    target = PROMPT_TOKENS // 4
    assert cache.decode_targets == [target] * len(cache.layers)
    assert max(lengths) <= target + INTERVAL - 1
    # NEW_TOKENS - 1 decode steps: a re-plan whenever a head reaches target + INTERVAL
    assert cache.stats["decode_compactions"] == (NEW_TOKENS - 1) // INTERVAL
    window = cache.window_size if policy != "custom" else 0
    for layer in cache.layers:
        assert layer.window == (window if policy != "custom" else 0)
        if window:
            assert layer.recent_queries is not None
            assert layer.recent_queries.shape[2] == window
    if policy == "custom":  # keeps the most recent tokens: the last re-plan kept a suffix
        positions = cache.layers[0].ragged.positions
        assert int(positions.max()) == PROMPT_TOKENS + NEW_TOKENS - 2


@pytest.mark.parametrize("policy", ["decoding_snapkv", "rkv"])
def test_protected_prompt_keeps_its_kept_tokens_and_bounds_generated_ones(
    policy: str, loaded: tuple[Any, Any], prompt: torch.Tensor
) -> None:
    """``protect_prompt``: the prompt's tokens kept at the prefill end all survive every
    re-plan, and the decode budget bounds only the generated tokens of each head."""
    from lmcompact.hf.cache import CompactingCache

    model, _ = loaded
    budget = 16
    cache = CompactingCache(
        model,
        policy,
        budget=0.25,
        interval=INTERVAL,
        decode_budget=budget,
        protect_prompt=True,
    )
    prompt_kept: list[list[set[int]]] = []
    generated_held: list[int] = []
    original = cache.after_decode_step

    def watched() -> None:
        if not prompt_kept:  # the first decode step: what the prefill compaction kept
            prompt_kept.extend(_positions(cache, below=PROMPT_TOKENS))
        original()
        for layer in cache.layers:
            held = layer.ragged.positions >= PROMPT_TOKENS
            counts = torch.zeros(layer.ragged.lengths().numel(), dtype=torch.long)
            counts.index_add_(0, layer.ragged.segment_ids(), held.long())
            generated_held.append(int(counts.max()))

    cache.after_decode_step = watched  # type: ignore[method-assign]
    tokens = generate(loaded, prompt, cache)
    assert len(tokens) == NEW_TOKENS
    assert cache.stats["decode_compactions"] >= 2  # 39 generated keys, budget 16 + 7 slack
    assert max(generated_held) <= budget + INTERVAL - 1
    assert _positions(cache, below=PROMPT_TOKENS) == prompt_kept
    kept = sum(len(head) for layer in prompt_kept for head in layer)
    assert kept == len(cache.layers) * cache.num_kv_heads * PROMPT_TOKENS // 4


def _positions(cache: Any, below: int) -> list[list[set[int]]]:
    """Per layer, per kv head: the kept positions under ``below`` (batch of one)."""
    out = []
    for layer in cache.layers:
        ragged = layer.ragged
        segment = ragged.segment_ids()
        heads: list[set[int]] = [set() for _ in range(ragged.num_kv_heads)]
        for pos, seg in zip(ragged.positions.tolist(), segment.tolist(), strict=True):
            if pos < below:
                heads[seg % ragged.num_kv_heads].add(pos)
        out.append(heads)
    return out
