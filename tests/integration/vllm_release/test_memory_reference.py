"""Compacted requests in vLLM generate what a masked reference model generates.

The reference is the same tiny Llama in transformers, run without any cache: every
generated token's query is masked from exactly the positions the release group dropped,
while prompt queries see the whole prompt. Matching greedy tokens (float32) show that the
engine attends to the kept tokens, at the right positions, and never to a returned block.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_release.harness import release_engine, run

pytestmark = pytest.mark.integration

PROMPT = tiny_prompt_ids(300, seed=11)  # 9 full blocks of 32 + 12 tokens
BASE = {"store": False, "budget": 0.5}

Dropped = Callable[[int], range | list[int]]
"""Key positions a query at position q (q >= prompt length) must not see."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


def masked_greedy(
    model_dir: str, prompt: list[int], new_tokens: int, dropped: Dropped
) -> list[int]:
    """Greedy tokens of the transformers model with the connector's drops as a mask."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            n = len(ids)
            allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
            for q in range(len(prompt), n):
                allowed[q, list(dropped(q))] = False
            mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
            logits = model(
                torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(n)[None]
            ).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def vllm_greedy(model_dir: str, extra: dict | None, new_tokens: int) -> list[int]:
    with release_engine(model_dir, extra, num_blocks=64) as llm:
        return run(llm, {"r": PROMPT}, new_tokens)["r"]


def test_plain_vllm_matches_reference(tiny_model: str) -> None:
    """Sanity check of the comparison itself: no compaction on either side."""
    assert vllm_greedy(tiny_model, None, 12) == masked_greedy(tiny_model, PROMPT, 12, lambda q: [])


def test_blocks_mode_matches_reference(tiny_model: str) -> None:
    """StreamingLLM at block granularity: sink block 0, recent blocks 6..8, hole 1..5."""
    extra = {**BASE, "policy": "streaming_llm", "release": {"prefill": "blocks"}}
    expected = masked_greedy(tiny_model, PROMPT, 12, lambda q: range(32, 192))
    assert vllm_greedy(tiny_model, extra, 12) == expected
    unmasked = masked_greedy(tiny_model, PROMPT, 12, lambda q: [])
    assert expected != unmasked  # the drop changes the output, so the match means something


def test_pack_mode_matches_reference(tiny_model: str) -> None:
    """Pack: StreamingLLM (4 sinks) keeps 128 of the 288 full-block tokens, copied into
    blocks 0..3; the worker moves tokens 164..287 into slots 4..127."""
    extra = {**BASE, "policy": "streaming_llm", "release": {"prefill": "pack"}}
    expected = masked_greedy(tiny_model, PROMPT, 12, lambda q: range(4, 164))
    assert vllm_greedy(tiny_model, extra, 12) == expected


def test_decode_budget_matches_reference(tiny_model: str) -> None:
    """Blocks mode plus a 6-block decode budget: from position 384 on, the hole grows one
    block per 32 generated tokens (query q drops blocks [1, 1 + max(5, q // 32 - 6)))."""
    extra = {
        **BASE,
        "policy": "streaming_llm",
        "release": {"prefill": "blocks", "decode_budget_tokens": 192},
    }

    def dropped(q: int) -> range:
        return range(32, 32 * (1 + max(5, q // 32 - 6)))

    expected = masked_greedy(tiny_model, PROMPT, 120, dropped)
    assert vllm_greedy(tiny_model, extra, 120) == expected
