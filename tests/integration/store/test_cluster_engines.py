"""Two vLLM CPU engines, each in its own process, sharing one 3-node Redis Cluster.

SmolLM2-135M in float32 (so a reload is token-identical, design notes 3). Each engine runs
in-process inside its own session process (vLLM's multiprocess mode works the same way,
``EngineClient(multiprocess=True)``, but starts in ~60 s instead of ~18 s here).

Engine A computes a prompt and stores its chunks in the cluster; engine B, which never saw
the prompt, finds them there (its scheduler asks the cluster) and loads them. Then a node
is killed between the passes: B serves the chunks before the first one on that node from
the cluster and recomputes the rest, and no request fails.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster

from tests.support.engine_client import engines
from tests.support.redis_cluster import RedisClusterProcess, redis_cluster_fixture

pytestmark = pytest.mark.integration

CHUNK = 128
MAX_TOKENS = 8
BUDGET = 0.5
redis_cluster = redis_cluster_fixture()


@pytest.fixture(scope="module")
def prompt(smollm2_path: Path) -> list[int]:
    from transformers import AutoTokenizer

    from lmcompact.cli.demo import build_prompt, haystack

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return build_prompt(tokenizer, haystack(tokenizer, 520, 0.5, seed=3))


def store_options(policy: dict[str, Any], cluster: RedisClusterProcess) -> dict[str, Any]:
    store = {"chunk_size": CHUNK, "tiers": ["cpu", "redis"], "redis_url": cluster.url}
    return {**policy, "store": store}


def wait_for_keys(cluster: RedisClusterProcess, keys: list[str], timeout_s: float = 60) -> None:
    """Wait until every key is in the cluster (an engine writes to Redis in the background)."""
    client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        deadline = time.monotonic() + timeout_s
        while sum(client.exists(k) for k in keys) < len(keys):
            assert time.monotonic() < deadline, "the engine's chunks never reached the cluster"
            time.sleep(0.1)
    finally:
        client.close()


def value_bytes(cluster: RedisClusterProcess, key: str) -> int:
    client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        return int(client.strlen(key))
    finally:
        client.close()


def test_a_prefix_stored_by_one_engine_is_a_compacted_hit_on_another(
    smollm2_path: Path, prompt: list[int], redis_cluster: RedisClusterProcess
) -> None:
    extra = store_options({"policy": "self_info", "budget": BUDGET}, redis_cluster)
    with engines(2, str(smollm2_path), extra) as (a, b):
        first = a.generate(prompt, MAX_TOKENS)  # computed, stored compacted
        keys = a.redis_keys(prompt)
        assert b.redis_keys(prompt) == keys  # one namespace: B looks where A wrote
        wait_for_keys(redis_cluster, keys)
        own = a.generate(prompt, MAX_TOKENS)  # A loads from its own store (its CPU tier)
        shared = b.generate(prompt, MAX_TOKENS)  # B loads A's chunks from the cluster
        b_own = b.generate(prompt, MAX_TOKENS)  # B again: from its CPU tier (promoted there)
    stored = len(keys) * CHUNK
    assert len(keys) >= 3 and first["cached"] == 0
    for out in (own, shared, b_own):
        assert out["cached"] == stored, (own, shared, b_own)
    assert shared["tokens"] == own["tokens"] == b_own["tokens"]
    full = 30 * 3 * CHUNK * 64 * 2 * 4  # layers x kv heads x tokens x dims x (K, V) x fp32
    assert all(value_bytes(redis_cluster, k) <= (BUDGET + 0.05) * full for k in keys)
    owners = {redis_cluster.node_of(k.encode()) for k in keys}
    assert len(owners) >= 2  # the prefix spans nodes (no hash tags)


def test_node_killed_between_passes_recomputes_and_matches_the_baseline(
    smollm2_path: Path, prompt: list[int], redis_cluster: RedisClusterProcess
) -> None:
    extra = store_options({"policy": "none"}, redis_cluster)
    with engines(2, str(smollm2_path), extra) as (a, b):
        baseline = a.generate(prompt, MAX_TOKENS)  # computed in full: the baseline
        keys = a.redis_keys(prompt)
        wait_for_keys(redis_cluster, keys)
        owner = [redis_cluster.node_of(k.encode()) for k in keys]
        victim = next(o for o in owner[1:] if o != owner[0])  # keep chunk 0 loadable
        redis_cluster.kill(victim)
        served = owner.index(victim)  # B's stored prefix ends at the first lost chunk
        after = [b.generate(prompt, MAX_TOKENS) for _ in range(2)]  # same answer twice
        again = a.generate(prompt, MAX_TOKENS)  # A still has its CPU tier
    assert baseline["cached"] == 0
    for out in (*after, again):
        assert out["finish"] == "length" and len(out["tokens"]) == MAX_TOKENS  # 0 failed
        assert out["tokens"] == baseline["tokens"]
    assert after[0]["cached"] == served * CHUNK, (served, after[0])
    # B's scheduler knows the chunks its worker saved, but it asks the store for the ones
    # it loaded, and the store's prefix still ends at the dead node: no more is served
    assert after[1]["cached"] >= served * CHUNK
    assert again["cached"] == len(keys) * CHUNK
