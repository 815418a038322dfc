"""PagedCache in ``generate`` on SmolLM2 (float32): exactness, accounting, compaction, int8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import StoppingCriteria  # noqa: E402

from lmcompact.hf.attention import enable_lmcompact_attention  # noqa: E402
from lmcompact.hf.paged import PagedCache, blocks_needed  # noqa: E402
from lmcompact.policies import make_policy  # noqa: E402

NEW = 12
BLOCK = 16


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def prompt(smollm2_path: Path) -> torch.Tensor:
    from pydoc_data.topics import topics

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    text = topics["if"] + topics["while"]
    return tokenizer(text, return_tensors="pt").input_ids[:, :90]


class AccountingCheck(StoppingCriteria):
    """Checks the pool's reference counts against the block tables at every step."""

    def __init__(self, cache: PagedCache) -> None:
        self.cache = cache
        self.steps = 0

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.cache.check_accounting()
        self.steps += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _generate(model: Any, ids: torch.Tensor, beams: int, cache: Any = None, **extra: Any) -> Any:
    if cache is None:
        model.set_attn_implementation("sdpa")
    else:
        enable_lmcompact_attention(model)
    with torch.inference_mode():
        return model.generate(
            ids,
            num_beams=beams,
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            past_key_values=cache,
            **extra,
        )


def _cache(model: Any, beams: int, length: int, **kwargs: Any) -> PagedCache:
    blocks = blocks_needed(model.config, beams, length + NEW, BLOCK)
    return PagedCache(model.config, num_blocks=blocks, block_size=BLOCK, **kwargs)


@pytest.mark.parametrize("beams", [1, 4])
def test_paged_outputs_equal_dynamic_cache(model: Any, prompt: torch.Tensor, beams: int) -> None:
    expected = _generate(model, prompt, beams)
    cache = _cache(model, beams, prompt.shape[1])
    check = AccountingCheck(cache)
    got = _generate(model, prompt, beams, cache, stopping_criteria=[check])
    assert torch.equal(got, expected)
    assert check.steps == NEW
    cache.check_accounting()
    # decode steps went through the one-pass-per-step path (its buffers hold the last step)
    step = cache.shared.step
    assert step is not None and step.batch == beams
    assert step.lengths(0).seq_len.tolist() == [prompt.shape[1] + NEW - 1] * beams
    if beams > 1:
        # the prompt is stored once for all beams: its blocks carry one reference per beam
        first = cache.paged_layers[0].table
        assert first is not None
        assert int(cache.pool.refcount[int(first.blocks[0, 0])]) == beams
        per_layer = -(-(prompt.shape[1] + NEW) // BLOCK)
        assert cache.pool.num_used < beams * per_layer * len(cache.layers)
    cache.reset()
    assert cache.pool.is_pristine()


def test_model_without_lmcompact_attention_is_refused(model: Any, prompt: torch.Tensor) -> None:
    model.set_attn_implementation("sdpa")
    cache = _cache(model, 1, prompt.shape[1])
    with pytest.raises(RuntimeError, match="never attended"), torch.inference_mode():
        model.generate(prompt, max_new_tokens=3, do_sample=False, past_key_values=cache)


@pytest.mark.parametrize("policy", ["streaming_llm", "snapkv"])
def test_compaction_frees_whole_blocks(model: Any, prompt: torch.Tensor, policy: str) -> None:
    beams, length = 4, prompt.shape[1]
    cache = _cache(model, beams, length, policy=make_policy(policy, budget=0.5))
    check = AccountingCheck(cache)
    _generate(model, prompt, beams, cache, stopping_criteria=[check])
    plan = cache.last_plan
    assert plan is not None and plan.compression_ratio == pytest.approx(0.5, abs=0.02)
    layers = len(cache.layers)
    prompt_blocks = -(-length // BLOCK)
    packed_blocks = -(-round(length * 0.5) // BLOCK)
    assert cache.pool.peak_used >= layers * prompt_blocks  # the shared prompt, before compaction
    # after compaction: the packed prompt (shared by the beams) plus each beam's own tail
    first = cache.paged_layers[0].table
    assert first is not None
    assert first.tail_start == packed_blocks * BLOCK
    assert torch.equal(
        first.blocks[:, :packed_blocks], first.blocks[:1, :packed_blocks].expand(beams, -1)
    )
    tail_blocks = -(-NEW // BLOCK) + 1  # the decode tail, and at most one copy-on-write spare
    assert cache.pool.num_used <= layers * (packed_blocks + beams * tail_blocks)
    assert int(first.kept.min()) >= 1 and int(first.kept.max()) <= packed_blocks * BLOCK
    cache.check_accounting()
    cache.reset()
    assert cache.pool.is_pristine()


def test_int8_kv_bounded_error_and_greedy_tokens(model: Any, prompt: torch.Tensor) -> None:
    """int8 K/V: next-token log-probs stay close to float32; short greedy output is unchanged."""
    enable_lmcompact_attention(model)
    logprobs = []
    for kv_dtype in ("auto", "int8"):
        cache = _cache(model, 1, prompt.shape[1], kv_dtype=kv_dtype)
        with torch.inference_mode():
            out = model(prompt[:, :-1], past_key_values=cache, use_cache=True)
            out = model(prompt[:, -1:], past_key_values=cache, use_cache=True)
        logprobs.append(torch.log_softmax(out.logits[0, -1], dim=-1))
        cache.reset()
    top = logprobs[0].topk(10).indices
    assert (logprobs[0][top] - logprobs[1][top]).abs().max() < 0.1
    expected = _generate(model, prompt, 1)
    cache = _cache(model, 1, prompt.shape[1], kv_dtype="int8")
    got = _generate(model, prompt, 1, cache)
    assert torch.equal(got, expected)
    spec = cache.spec
    assert spec is not None
    assert cache.kv_bytes() == cache.pool.num_used * spec.bytes_per_block > 0
    assert spec.bytes_per_block < 0.3 * (2 * BLOCK * 3 * 64 * 4)
    cache.reset()
    assert cache.pool.is_pristine()


def test_lossless_compaction_of_distinct_rows_matches_dynamic(
    model: Any, prompt: torch.Tensor
) -> None:
    """Two different prompts (rows not shared): a budget of 1.0 moves every token and must
    give DynamicCache's greedy output; each row is planned from its own observation."""
    batch = torch.cat([prompt[:, :60], prompt[:, 30:90]])
    expected = _generate(model, batch, 1)
    cache = _cache(model, 2, 60, policy=make_policy("snapkv", budget=1.0))
    check = AccountingCheck(cache)
    got = _generate(model, batch, 1, cache, stopping_criteria=[check])
    assert torch.equal(got, expected)
    first = cache.paged_layers[0].table
    assert first is not None and int(first.kept.min()) == 60
    assert not torch.equal(first.blocks[0], first.blocks[1])
    cache.reset()
    assert cache.pool.is_pristine()
