"""Connector round trips on a real vLLM CPU engine with a tiny random-weight Llama (fast)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.vllm.engine import BLOCK_SIZE, engine, greedy, worker_connector
from tests.integration.vllm.probes import (
    PrefillRecorder,
    attention_vs_reference,
    compacted_prefix,
    stored_chunks,
)
from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids

pytestmark = pytest.mark.integration

CHUNK = 64
PROMPT = tiny_prompt_ids(300, seed=3)  # 4 full chunks + a 44-token tail


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


def test_layout_matches_transformers_kv(tiny_model: str) -> None:
    """K/V read from vLLM's CPU pages through the layout module equal HF's post-RoPE K/V."""
    from transformers import AutoModelForCausalLM

    extra = {"policy": "none", "store": {"chunk_size": CHUNK, "async_save": False}}
    with engine(tiny_model, extra) as llm:
        connector = worker_connector()
        half = connector.worker
        name = next(iter(half.layers))
        recorder = PrefillRecorder([name])
        half.observers.append(recorder)
        greedy(llm, PROMPT, max_tokens=1)
        row = recorder.calls[name][0]["block_row"]
        keys, values = half.layout.read(half.kv_caches[name], row, 0, len(PROMPT))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    with torch.no_grad():
        past = hf(torch.tensor([PROMPT]), use_cache=True).past_key_values
    hf_k, hf_v = past.layers[0].keys[0], past.layers[0].values[0]  # (H, T, D)
    torch.testing.assert_close(keys, hf_k, atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(values, hf_v, atol=2e-4, rtol=1e-3)


def test_policy_none_store_hit_is_token_identical(tiny_model: str) -> None:
    with engine(tiny_model, None) as llm:
        baseline = greedy(llm, PROMPT)
    with engine(tiny_model, {"policy": "none", "store": {"chunk_size": CHUNK}}) as llm:
        first = greedy(llm, PROMPT)
        connector = worker_connector()
        connector.worker.drain()
        second = greedy(llm, PROMPT)
        stats = dict(connector.worker.stats)
    assert first == baseline
    assert stats["saved_chunks"] == 4 and stats["loaded_chunks"] == 4
    assert second == baseline


def test_compaction_attends_exactly_to_kept_tokens(tiny_model: str) -> None:
    """Budget 0.5: stored bytes <= 0.55 x full, and the engine's attention over the loaded
    compacted prefix equals ``ragged_attention`` over the stored kept tokens + the tail."""
    extra = {"policy": "snapkv", "budget": 0.5, "store": {"chunk_size": CHUNK}, "window": 16}
    with engine(tiny_model, extra) as llm:
        connector = worker_connector()
        half = connector.worker
        greedy(llm, PROMPT, max_tokens=2)
        half.drain()
        assert half.stats["saved_chunks"] == 4
        assert half.stats["bytes_stored"] <= 0.55 * half.stats["bytes_full"]
        layer_name = list(half.layers)[1]
        recorder = PrefillRecorder([layer_name])
        half.observers.append(recorder)
        greedy(llm, PROMPT, max_tokens=2)
        assert half.stats["loaded_chunks"] == 4
        call = recorder.calls[layer_name][0]
        chunks = stored_chunks(connector, PROMPT)
        kept = half.kept
        n_prefix = 4 * CHUNK
        tail = len(PROMPT) - n_prefix
        assert call["seq_len"] == 4 * kept + tail  # the hole is skipped
        tail_k, tail_v = half.layout.read(
            half.kv_caches[layer_name], call["block_row"], 4 * kept, tail
        )
    prefix = compacted_prefix(chunks, 1, half.facts.num_kv_heads, CHUNK)
    got, expected = attention_vs_reference(
        call, prefix, tail_k, tail_v, n_prefix, len(PROMPT), half.facts.head_dim
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # and it is not plain full attention: half of the prefix is really gone
    assert 4 * kept == n_prefix // 2


def test_corrupted_entry_is_rejected_and_recomputed(tiny_model: str) -> None:
    """A malformed chunk in the CPU tier is refused by the worker when it loads it; vLLM
    recomputes the request from the load's start, exactly, and the chunk is stored again."""
    from lmcompact.store import ChunkKeyer

    with engine(tiny_model, None) as llm:
        baseline = greedy(llm, PROMPT)
    with engine(tiny_model, {"policy": "none", "store": {"chunk_size": CHUNK}}) as llm:
        connector = worker_connector()
        greedy(llm, PROMPT)
        connector.worker.drain()
        keyer = ChunkKeyer(connector.spec.namespaces[connector.tp_rank], CHUNK)
        second_key = keyer.keys(PROMPT)[1]
        cpu = connector.store.tier("cpu")
        good = cpu.get(second_key)
        assert good is not None
        counts = good.kept_counts.clone()
        counts[-1, -1] -= 1  # one head lost a row: no longer the engine's shape
        bad = type(good)(
            good.keys[:-1].clone(),
            good.values[:-1].clone(),
            counts,
            good.positions[:-1].clone(),
            good.num_tokens,
        )
        cpu.delete(second_key)
        assert cpu.put(second_key, bad)
        out = greedy(llm, PROMPT)
        stats = connector.worker.stats
        assert stats["rejected_chunks"] == 1 and stats["load_failures"] == 1
        assert stats["loaded_chunks"] == 0  # nothing of a refused load is written
        connector.worker.drain()
        stored_again = cpu.get(second_key)
        assert stored_again is not None and stored_again.total_kept == good.total_kept
    assert out == baseline


def test_bad_options_fail_at_start_up(tiny_model: str) -> None:
    bad_chunk = engine(tiny_model, {"policy": "none", "store": {"chunk_size": BLOCK_SIZE + 16}})
    with pytest.raises(Exception, match="chunk_size 48 must be a multiple"), bad_chunk:
        pass
