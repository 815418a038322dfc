"""``step_trace``: one line per engine step and one per pack, from a real engine.

SmolLM2 (real weights) in vLLM's CPU engine, SnapKV 0.5 packed in place: two prompts of
~600 tokens with a token budget of 256 per step, so their prefills run in chunks beside
decode rows. The scheduler's lines count what each step held; the worker's pack lines name
steps that ended a prefill; ``lmcompact bench itl`` reads the files back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcompact.bench import itl
from tests.integration.vllm_release.harness import release_engine, run
from tests.integration.vllm_release.test_long_generation import text_prompt

pytestmark = pytest.mark.integration


def test_steps_and_packs_are_traced(smollm2_path: Path, tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    prompts = {"a": text_prompt(smollm2_path, 600), "b": text_prompt(smollm2_path, 620)[20:]}
    extra = {
        "policy": "snapkv",
        "budget": 0.5,
        "store": False,
        "release": {"prefill": "pack"},
        "step_trace": str(trace),
    }
    counts: list[int] = []
    with release_engine(
        str(smollm2_path), extra, max_model_len=1024, max_num_batched_tokens=256
    ) as llm:
        tokens = run(llm, prompts, 8, lambda step, outputs: counts.append(step))
    assert all(len(t) == 8 for t in tokens.values())

    steps, packs = itl.read_trace(trace)
    assert len(steps) == len(counts)  # one line per engine step, in order
    assert [s["step"] for s in steps] == sorted(s["step"] for s in steps)
    prompt_tokens = sum(len(p) for p in prompts.values())
    assert sum(s["prefill_tokens"] for s in steps) == prompt_tokens
    assert all(s["prefill_tokens"] <= 256 for s in steps)
    assert sum(s["decode_rows"] for s in steps) == 2 * 7  # the 7 tokens after the first
    assert any(s["prefill_rows"] and s["decode_rows"] for s in steps)  # chunks beside decodes
    assert sum(s["packs"] for s in steps) == 2
    by_step = {s["step"]: s for s in steps}
    assert len({p["req"] for group in packs.values() for p in group}) == 2  # one per request
    for step, group in packs.items():
        assert by_step[step]["packs"] == len(group)  # a pack names the step that planned it
        assert all(p["gpu_ms"] > 0 for p in group)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert all(line["kind"] == "step" for line in lines)
