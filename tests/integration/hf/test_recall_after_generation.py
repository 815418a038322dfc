"""The recall-after-generation task (``lmcompact.eval.recall_after_generation``) on the real
SmolLM2: feeding the pieces chunk by chunk through a full cache gives transformers' own
greedy answer, the full cache recalls every fact of a short prompt, and a decode budget
below the prompt runs through the compacting cache (its compactions counted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmcompact.eval.recall_after_generation import FULL, answer, build_cases, run_cell

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def loaded(smollm2_path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcompact.hf.attention import enable_lmcompact_attention

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    return enable_lmcompact_attention(model), tokenizer


def test_pieces_through_a_full_cache_give_the_greedy_answer(loaded: tuple[Any, Any]) -> None:
    from transformers import DynamicCache

    model, tokenizer = loaded
    ((stored, generated),) = build_cases(tokenizer, 256, 48, 1, seed=5)
    pieces = [torch.tensor(stored.context_ids), generated, torch.tensor(stored.question_ids[0])]
    got = answer(model, DynamicCache(config=model.config), pieces, 16, 6)
    whole = torch.cat(pieces)[None]
    with torch.no_grad():
        want = model.generate(
            whole,
            past_key_values=DynamicCache(config=model.config),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )[0, whole.shape[1] :].tolist()
    assert got == want


def test_full_cache_recalls_and_a_budget_compacts(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    cases = build_cases(tokenizer, 256, 64, 1, seed=0)
    full = run_cell(model, tokenizer, cases, FULL, None, 32, 8)
    assert (full.n, full.accuracy, full.decode_compactions) == (3, 1.0, 0)
    recent = run_cell(model, tokenizer, cases, "streaming_llm", 128, 32, 8)
    assert recent.n == 3 and recent.decode_compactions >= 3  # each run re-planned
