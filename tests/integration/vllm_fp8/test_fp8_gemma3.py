"""Gemma-3 (15 of 18 layers slide over 512 tokens) with an fp8 KV cache, compacted in vLLM,
equals the fp8 reference with the sliding windows applied by logical position.

The scenario of :mod:`tests.integration.vllm_sliding.test_gemma3_compacted` (SnapKV 0.5 in
place, then the same prompt loaded from 4 stored chunks), on ``kv_cache_dtype="fp8"``, against
:mod:`tests.integration.vllm_fp8.reference` (K/V rounded as the CPU fp8 kernel stores them).

On this model the reference does not copy vLLM's fp8 attention exactly (not found why; in
float32 it matches to 5e-6, and on the tiny Llama in fp8 to 1e-4): the plain fp8 engine,
without the connector, gives the reference's tokens with log-probabilities up to 0.10
apart. So the tolerance is that engine's own gap: the compacted engine must give the
reference's tokens, with a gap within ``FP8_GAP_FACTOR`` times the plain one. A mask that
misses the sliding windows changes the tokens at once (as in the float32 test).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.vllm_fp8.reference import load as load_fp8_reference
from tests.integration.vllm_release.harness import BLOCK_SIZE
from tests.integration.vllm_sliding import reference
from tests.integration.vllm_sliding.recording import Seen, recording
from tests.integration.vllm_sliding.test_gemma3_compacted import (
    CHUNK,
    EXTRA,
    LOGPROB_ATOL,
    NEW_TOKENS,
    _generate,
    _prompt,
    _sliding_layers,
)

Output = tuple[list[int], list[float]]
FP8_GAP_FACTOR = 1.25

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(gemma3_path: Path) -> Iterator[tuple[list[int], Seen]]:
    from connectors.vllm.offline import engine

    prompt = _prompt(gemma3_path)
    options = {"block_size": BLOCK_SIZE, "max_model_len": 2048, "kv_cache_dtype": "fp8"}
    with recording() as seen, engine(str(gemma3_path), EXTRA, **options) as llm:
        seen.outputs.append(_generate(llm, prompt))  # packed in place, chunks saved
        seen.outputs.append(_generate(llm, prompt))  # loaded from the store
    yield prompt, seen


@pytest.fixture(scope="module")
def model(gemma3_path: Path) -> Any:
    return load_fp8_reference(str(gemma3_path))


def _gap(a: Output, b: Output) -> float:
    return max(abs(x - y) for x, y in zip(a[1], b[1], strict=True))


@pytest.fixture(scope="module")
def fp8_gap(gemma3_path: Path, served: tuple[list[int], Seen], model: Any) -> float:
    """The plain fp8 engine's log-probability gap to the reference (no connector)."""
    from connectors.vllm.offline import engine

    prompt, _ = served
    options = {"block_size": BLOCK_SIZE, "max_model_len": 2048, "kv_cache_dtype": "fp8"}
    with engine(str(gemma3_path), None, **options) as llm:
        plain = _generate(llm, prompt)
    ref = reference.greedy(model, prompt, NEW_TOKENS, None)
    assert plain[0] == ref[0]
    print(f"plain fp8 engine vs reference: gap {_gap(plain, ref):.2e}")
    return _gap(plain, ref)


def _check_same(engine: Output, ref: Output, fp8_gap: float) -> None:
    print(f"engine {engine[0]}\nreference {ref[0]}\ngap {_gap(engine, ref):.2e}")
    assert engine[0] == ref[0]
    assert _gap(engine, ref) <= FP8_GAP_FACTOR * fp8_gap + LOGPROB_ATOL


def test_fp8_in_place_pack_equals_masked_reference(
    served: tuple[list[int], Seen], model: Any, fp8_gap: float
) -> None:
    prompt, seen = served
    assert len(seen.packs) == 1
    num_tokens, chosen = seen.packs[0]
    kept = chosen[0][0].numel()
    for layer in _sliding_layers(model):
        for head in chosen[layer]:
            assert torch.equal(head, torch.arange(num_tokens - kept, num_tokens))
    compaction = reference.Compaction(span=num_tokens, from_query=len(prompt), kept=chosen)
    _check_same(seen.outputs[0], reference.greedy(model, prompt, NEW_TOKENS, compaction), fp8_gap)


def test_fp8_store_load_equals_masked_reference(
    served: tuple[list[int], Seen], model: Any, fp8_gap: float
) -> None:
    prompt, seen = served
    assert len(seen.loads) == 1
    _, chunks = seen.loads[0]
    assert all(chunk.keys.dtype == torch.uint8 for chunk in chunks)
    n = len(chunks)
    sliding = set(_sliding_layers(model))
    kept: list[list[torch.Tensor]] = []
    for layer in range(model.config.num_hidden_layers):
        heads = []
        for head in range(model.config.num_key_value_heads):
            per_chunk = []
            for i, chunk in enumerate(chunks):
                count = int(chunk.kept_counts[0, 0])
                rows = chunk.positions.view(*chunk.kept_counts.shape, count)[layer, head]
                if layer in sliding and i < n - 1:  # only the last chunk's recent rows are seen
                    continue
                per_chunk.append(rows.long() + i * CHUNK)
            heads.append(torch.cat(per_chunk))
        kept.append(heads)
    compaction = reference.Compaction(span=n * CHUNK, from_query=n * CHUNK, kept=kept)
    _check_same(seen.outputs[1], reference.greedy(model, prompt, NEW_TOKENS, compaction), fp8_gap)
