"""CompactingCache on the real SmolLM2: exactness at budget 1.0, real byte savings, decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmcompact.eval.policies import policy_for
from lmcompact.eval.text import text_stream
from lmcompact.policies.registry import available_policies

pytestmark = pytest.mark.integration

PROMPT_TOKENS = 320
NEW_TOKENS = 8


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


@pytest.fixture(scope="module")
def reference(loaded: tuple[Any, Any], prompt: torch.Tensor) -> list[int]:
    from transformers import DynamicCache

    model, tokenizer = loaded
    out = model.generate(
        prompt,
        past_key_values=DynamicCache(config=model.config),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return out[0, PROMPT_TOKENS:].tolist()


def generate(loaded: tuple[Any, Any], prompt: torch.Tensor, cache: Any, n: int) -> list[int]:
    model, tokenizer = loaded
    with torch.no_grad():
        out = model.generate(
            prompt,
            past_key_values=cache,
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("name", available_policies())
def test_budget_one_reproduces_the_full_cache(
    name: str, loaded: tuple[Any, Any], prompt: torch.Tensor, reference: list[int]
) -> None:
    from lmcompact.hf.cache import CompactingCache

    model, tokenizer = loaded
    policy = policy_for(name, 1.0, PROMPT_TOKENS)
    if policy.scores_given:
        # scores only an integration supplies (self_info: vLLM's prompt logprobs)
        with pytest.raises(ValueError, match="supplies"):
            CompactingCache(model, policy, tokenizer=tokenizer)
        return
    cache = CompactingCache(model, policy, tokenizer=tokenizer)
    assert generate(loaded, prompt, cache, NEW_TOKENS) == reference
    assert cache.kept_ratio() == 1.0


def test_bytes_shrink_with_the_budget(loaded: tuple[Any, Any], prompt: torch.Tensor) -> None:
    from lmcompact.hf.cache import CompactingCache

    model, _ = loaded
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    held = {}
    for budget in (1.0, 0.5, 0.25, 0.1):
        cache = CompactingCache(model, "knorm", budget=budget)
        with torch.no_grad():
            model(prompt, past_key_values=cache)
        full = cache.full_nbytes()
        kept_tokens = round(budget * PROMPT_TOKENS) * layers * heads
        metadata = kept_tokens * 8 + layers * (heads + 1) * 8  # int64 positions + offsets
        assert abs(cache.nbytes() - budget * full) <= 0.05 * budget * full + metadata
        held[budget] = cache.nbytes()
    assert held[1.0] > held[0.5] > held[0.25] > held[0.1]
    # float32 K+V of 30 layers x 3 heads x 64 dims: 46,080 bytes per token
    assert full == PROMPT_TOKENS * 2 * layers * heads * 64 * 4


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming_llm"])
def test_generate_with_decode_time_policy(
    name: str, loaded: tuple[Any, Any], prompt: torch.Tensor
) -> None:
    from lmcompact.hf.cache import CompactingCache

    model, _ = loaded
    cache = CompactingCache(model, name, budget=0.25, decode_slack=2)
    tokens = generate(loaded, prompt, cache, 12)
    assert len(tokens) == 12
    assert cache.stats["decode_compactions"] >= 2
    assert cache.decode_targets is not None
    for layer, target in zip(cache.layers, cache.decode_targets, strict=True):
        assert layer.ragged is not None
        assert int(layer.ragged.lengths().max()) <= target + 2
    # logical positions keep counting every token, kept or dropped
    assert cache.get_seq_length() == PROMPT_TOKENS + 11


def test_prefill_only_policy_keeps_growing_during_decode(
    loaded: tuple[Any, Any], prompt: torch.Tensor
) -> None:
    from lmcompact.hf.cache import CompactingCache

    model, _ = loaded
    cache = CompactingCache(model, "snapkv", budget=0.25)
    generate(loaded, prompt, cache, 6)
    assert cache.decode_targets is None and cache.stats["decode_compactions"] == 0
    lengths = cache.layers[0].ragged.lengths()
    assert int(lengths.max()) == 80 + 5  # 25% of 320 plus the 5 appended decode tokens


def test_window_scores_match_eager_attention(loaded: tuple[Any, Any], prompt: torch.Tensor) -> None:
    """The window mass captured inside the forward equals eager attention's last rows."""
    from lmcompact.attention.scores import window_scores_naive
    from lmcompact.hf.cache import CompactingCache

    model, _ = loaded
    captured: dict[str, torch.Tensor] = {}
    cache = CompactingCache(model, "snapkv", budget=0.5)
    layer = cache.layers[5]
    original = layer.attend

    def spy(module, query, key, value, scaling, **kwargs):  # type: ignore[no-untyped-def]
        captured["q"], captured["k"] = query.detach().clone(), key.detach().clone()
        out = original(module, query, key, value, scaling, **kwargs)
        return out

    layer.attend = spy  # type: ignore[method-assign]
    original_compact = cache.compact

    def keep_observation() -> None:
        captured["mass"] = cache.layers[5].observations[0].window_scores.clone()
        original_compact()

    cache.compact = keep_observation  # type: ignore[method-assign]
    with torch.no_grad():
        model(prompt, past_key_values=cache)
    naive = window_scores_naive(captured["q"][:, :, -32:], captured["k"])
    torch.testing.assert_close(captured["mass"], naive[0], rtol=1e-4, atol=1e-5)


def test_kvzip_scores_are_the_connectors(loaded: tuple[Any, Any], prompt: torch.Tensor) -> None:
    """The transformers path and the vLLM save path score kvzip alike: the context scores
    captured inside the forward equal the connector's on the same queries and keys."""
    from lmcompact.compaction.policy_inputs import layer_observation
    from lmcompact.compaction.save_job import SaveJob
    from lmcompact.hf.cache import CompactingCache
    from lmcompact.hf.observe import rope_from_model

    model, _ = loaded
    captured: dict[str, torch.Tensor] = {}
    policy = policy_for("kvzip", 0.5, PROMPT_TOKENS)
    policy.max_queries = 200  # type: ignore[attr-defined]  # sample, not every query
    cache = CompactingCache(model, policy)
    layer = cache._layers()[5]
    original = layer.attend

    def spy(module, query, key, value, scaling, **kwargs):  # type: ignore[no-untyped-def]
        captured["q"], captured["k"] = query.detach().clone(), key.detach().clone()
        captured["scale"] = torch.tensor(scaling)
        return original(module, query, key, value, scaling, **kwargs)

    layer.attend = spy  # type: ignore[method-assign]
    original_compact = cache.compact

    def keep_observation() -> None:
        assert layer.observations is not None
        observation = layer.observations[0]
        assert observation.context_scores is not None
        captured["scores"] = observation.context_scores.clone()
        original_compact()

    cache.compact = keep_observation  # type: ignore[method-assign]
    with torch.no_grad():
        model(prompt, past_key_values=cache)
    positions = policy.context_queries(PROMPT_TOKENS)
    assert positions is not None and positions.numel() == 200
    rope = rope_from_model(model)
    assert rope is not None
    queries = captured["q"][0].permute(1, 0, 2)[positions]  # (S, Hq, D) as the worker copies
    job = SaveJob(
        "r", [], 0, PROMPT_TOKENS, [], [queries], positions, float(captured["scale"]), rope=rope
    )
    _, sample = job.layer_queries(0, policy)  # the sample the save path scores
    theirs = layer_observation(
        policy.needs,
        captured["k"][0],
        sample=sample,
        scale=job.scale,
        context_shift=policy.context_shift(job.prompt_len),
        rope=job.rope,
    ).context_scores
    assert theirs is not None
    torch.testing.assert_close(captured["scores"], theirs, rtol=1e-4, atol=1e-6)
    assert cache.plans is not None
    assert bool((cache.plans[0].kept_counts() == PROMPT_TOKENS // 2).all())


def test_expected_attention_plans_are_the_connectors(
    loaded: tuple[Any, Any], prompt: torch.Tensor
) -> None:
    """Expected Attention keeps the same tokens in transformers and on the vLLM save path:
    statistics from the window and the prompt sample, one softmax over the span."""
    from lmcompact.compaction.page_layout import CpuPageLayout
    from lmcompact.compaction.save_job import SaveJob, compact_job
    from lmcompact.hf.cache import CompactingCache
    from lmcompact.hf.observe import rope_from_model
    from lmcompact.store import ChunkKeyer, StoreNamespace

    model, _ = loaded
    policy = policy_for("expected_attention", 0.5, PROMPT_TOKENS)
    policy.max_queries = 100  # type: ignore[attr-defined]  # a sample, not every query
    cache = CompactingCache(model, policy, window_size=32)
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    scale: list[float] = []
    for layer in cache._layers():
        original = layer.attend

        def spy(module, query, key, value, scaling, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            captured.append((query[0].detach().clone(), key[0].detach().clone(), value[0].clone()))
            scale.append(float(scaling))
            return _original(module, query, key, value, scaling, **kwargs)

        layer.attend = spy  # type: ignore[method-assign]
    with torch.no_grad():
        model(prompt, past_key_values=cache)
    assert cache.plans is not None
    sampled = policy.context_queries(PROMPT_TOKENS)
    assert sampled is not None and sampled.numel() == 100
    positions = torch.cat([sampled, torch.arange(PROMPT_TOKENS - 32, PROMPT_TOKENS)]).unique()
    layout = CpuPageLayout(32)
    pages = [layout.tokens_to_pages(k, v) for _, k, v in captured]
    queries = [q.permute(1, 0, 2)[positions] for q, _, _ in captured]  # (S, Hq, D)
    keys = ChunkKeyer(StoreNamespace("m", "float32", "rows"), PROMPT_TOKENS).keys(
        prompt[0].tolist()
    )
    job = SaveJob(
        "r",
        keys,
        0,
        PROMPT_TOKENS,
        pages,
        queries,
        positions,
        scale[0],
        window=32,
        rope=rope_from_model(model),
    )
    ((_, chunk),) = compact_job(job, layout, policy, PROMPT_TOKENS, PROMPT_TOKENS // 2)
    hf = cache.plans[0]
    differ = 0
    for index in range(len(captured)):
        for head in range(chunk.num_kv_heads):
            ours = set(chunk.head(index, head)[2].tolist())
            differ += len(ours ^ set(hf.kept[index][head].tolist()))
    assert differ == 0
