"""Connector round trips with SmolLM2-135M on real vLLM (CPU), the CPU tier and real Redis.

Exactness is judged in float32 against a run without the connector (design-notes 3).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm.engine import engine, greedy, worker_connector
from tests.redis_server import redis_server_fixture

pytestmark = pytest.mark.integration

redis_server = redis_server_fixture()
CHUNK = 128
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompt(smollm2_path: Path) -> list[int]:
    from transformers import AutoTokenizer

    from lmcompact.cli.demo import build_prompt, haystack

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return build_prompt(tokenizer, haystack(tokenizer, 600, 0.5, seed=1))


@pytest.fixture(scope="module")
def baseline(smollm2_path: Path, prompt: list[int]) -> list[int]:
    with engine(str(smollm2_path), None) as llm:
        return greedy(llm, prompt, MAX_TOKENS)


def stats() -> dict[str, Any]:
    half = worker_connector().worker
    half.drain()
    return dict(half.stats)


def test_policy_none_cpu_tier_token_identical(
    smollm2_path: Path, prompt: list[int], baseline: list[int]
) -> None:
    with engine(str(smollm2_path), {"policy": "none", "store": {"chunk_size": CHUNK}}) as llm:
        first = greedy(llm, prompt, MAX_TOKENS)
        stats()
        second = greedy(llm, prompt, MAX_TOKENS)
        counters = stats()
    assert first == baseline
    assert counters["loaded_chunks"] == len(prompt) // CHUNK
    assert second == baseline


def test_policy_none_redis_tier_corruption_and_outage(
    smollm2_path: Path, prompt: list[int], baseline: list[int], redis_server: Any
) -> None:
    """Redis-only store: a hit is token-identical; a damaged value is refused by the codec
    when the worker loads it, and the request recomputed; with Redis killed mid-run the
    scheduler still believes the chunks exist (from the worker's reports), the worker's
    fetch fails and the request is recomputed: still answered, exactly."""
    import redis

    from lmcompact.store import ChunkKeyer

    extra = {
        "policy": "none",
        "store": {"chunk_size": CHUNK, "tiers": ["redis"], "redis_url": redis_server.url},
    }
    with engine(str(smollm2_path), extra) as llm:
        connector = worker_connector()
        first = greedy(llm, prompt, MAX_TOKENS)
        stats()
        assert connector.store.flush(30.0)
        n_chunks = len(prompt) // CHUNK
        second = greedy(llm, prompt, MAX_TOKENS)
        assert stats()["loaded_chunks"] == n_chunks

        keys = ChunkKeyer(connector.spec.namespaces[connector.tp_rank], CHUNK).keys(prompt)
        tier = connector.store.tier("redis")
        client = redis.Redis.from_url(redis_server.url)
        raw = client.get(tier.redis_key(keys[2]))
        assert raw is not None
        damaged = bytearray(raw)
        damaged[-100] ^= 0xFF  # one flipped byte in the values payload
        client.set(tier.redis_key(keys[2]), bytes(damaged))
        client.close()
        third = greedy(llm, prompt, MAX_TOKENS)
        assert stats()["loaded_chunks"] == n_chunks  # the refused load wrote nothing
        assert stats()["load_failures"] == 1
        assert connector.store.flush(30.0)  # the recompute stored chunk 2 again

        redis_server.kill()
        fourth = greedy(llm, prompt, MAX_TOKENS)  # the fetch fails; recomputed
        assert stats()["loaded_chunks"] == n_chunks
        assert stats()["load_failures"] == 2
    assert first == second == third == fourth == baseline


def test_demo_needle_answered_at_half_budget(smollm2_path: Path, tmp_path: Path) -> None:
    from lmcompact.cli import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    out = tmp_path / "demo.json"
    args = parser.parse_args(
        ["--model", str(smollm2_path), "--json", str(out), "--context-tokens", "1200"]
    )
    code = demo.run(args)
    result = json.loads(out.read_text())
    assert result["store_hit"] is True
    assert result["bytes_stored"] <= 0.55 * result["bytes_full"]
    assert result["answer_correct"] is True, result["answer"]
    assert code == 0
