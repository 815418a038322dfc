"""kvpress's presses on the vLLM eval's prompts, in kvpress's own venv (skipped without it).

The worker answers every scorer press from one shared prefill by calling the press's own
forward hook with the recorded arguments; this checks that it gives what kvpress's
pipeline gives when it runs the prefill itself, and that the press really dropped tokens.
"""

from __future__ import annotations

import pytest

from lmcompact.eval.kvpress_bridge import kvpress_python, run_kvpress_stored
from lmcompact.eval.vllm_runner import VllmEvalConfig, build_cases

try:
    kvpress_python()
except RuntimeError as missing:
    pytest.skip(str(missing), allow_module_level=True)


def test_shared_prefill_matches_the_pipeline(smollm2_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = VllmEvalConfig(samples=1, contexts=[512], chunk_size=256, depths=[0.5])
    cases = build_cases(tokenizer, config, 512)
    spec = {"policy": "snapkv", "budget": 0.5, "compact_on": "save"}
    presses = [
        {"policy": "none", "budget": 1.0, "compact_on": "none"},
        spec,
        {**spec, "pipeline": True},
    ]
    rows, info = run_kvpress_stored(str(smollm2_path), "smollm2", cases, presses, 6, threads=1)
    assert info["complete"] and not info["refused"]
    by = {(r["policy"], bool(r.get("pipeline"))): r for r in rows}
    shared, pipeline = by[("snapkv", False)], by[("snapkv", True)]
    assert shared["answer"] == pipeline["answer"]
    assert shared["kept_tokens"] == 256 and by[("none", False)]["kept_tokens"] == 512
    assert all(r["engine"] == "kvpress" and r["accuracy"] in (0.0, 1.0) for r in rows)
