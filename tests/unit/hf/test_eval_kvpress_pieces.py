"""kvpress beside the vLLM eval without kvpress: configurations, scoring, side by side.

The real counterpart (kvpress's pipeline on a real model) is
``tests/integration/hf/test_kvpress_stored.py`` (runs where the kvpress venv exists).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmcompact.eval import kvpress_compare, vllm_report
from lmcompact.eval.kvpress_bridge import score_stored, stored_presses
from lmcompact.eval.vllm_runner import VllmEvalConfig, build_cases
from tests.unit.hf.test_eval_pieces import CharTokenizer


def test_presses_start_with_the_full_cache_and_keep_only_shared_methods() -> None:
    presses = stored_presses(["snapkv", "kvzip", "tova"], [0.5, 0.25], ["save", "inplace"])
    assert presses[0] == {"policy": "none", "budget": 1.0, "compact_on": "none"}
    got = {(p["compact_on"], p["policy"], p["budget"]) for p in presses[1:]}
    assert got == {
        ("load", "snapkv", 0.5),  # inplace asks for the question-in-window setting
        ("load", "snapkv", 0.25),
        ("save", "snapkv", 0.5),
        ("save", "snapkv", 0.25),
        ("save", "kvzip", 0.5),
        ("save", "kvzip", 0.25),
    }


def test_worker_answers_are_scored_against_each_questions_passkey() -> None:
    config = VllmEvalConfig(contexts=[600], chunk_size=256, samples=1)
    cases = build_cases(CharTokenizer(), config, 600)
    needles = cases[0].stored.needles
    spec = {"policy": "snapkv", "budget": 0.5, "compact_on": "save", "press": "SnapKVPress"}
    output = {
        "rows": [
            {
                **spec,
                "task": "multi_needle",
                "context": 600,
                "sample": 0,
                "question": q,
                "answer": f" {needles[q].passkey if q != 1 else '12345'}.",
                "seconds": 2.0,
                "kept_tokens": 300,
            }
            for q in range(3)
        ],
        "refused": [
            {
                "policy": "kvzip",
                "budget": 0.5,
                "compact_on": "save",
                "error": "ValueError: not supported",
            }
        ],
    }
    rows = score_stored(output, cases, "m")
    scored = [r for r in rows if "accuracy" in r]
    assert [r["accuracy"] for r in scored] == [1.0, 0.0, 1.0]
    assert all(r["engine"] == "kvpress" and r["model"] == "m" for r in rows)
    assert [r["passkey"] for r in scored] == [n.passkey for n in needles]
    refused = [r for r in rows if r.get("error")]
    assert len(refused) == 1 and refused[0]["task"] is None and refused[0]["context"] == 600


def _row(
    engine: str, mode: str, policy: str, budget: float, sample: int, q: int, accuracy: float
) -> dict[str, Any]:
    store = {"save": {"holes_adopted": 1}, "load": {"packs": 1, "blocks_released": 4}}
    return {
        "engine": engine,
        "model": "m",
        "task": "multi_needle",
        "context": 2048,
        "compact_on": mode,
        "policy": policy,
        "budget": budget,
        "sample": sample,
        "question": q,
        "accuracy": accuracy,
        "seconds": 1.0,
        **(store.get(mode, {}) if engine == "vllm" else {}),
    }


def test_side_by_side_pairs_methods_on_common_questions_only() -> None:
    rows = [
        # ours: 2 samples; kvpress: 3 samples (sample 2 must not count)
        *[_row("vllm", "save", "kvzip+reconstruct(share=True)", 0.5, s, 0, 1.0) for s in (0, 1)],
        *[
            _row("kvpress", "save", "kvzip", 0.5, s, 0, a)
            for s, a in ((0, 1.0), (1, 1.0), (2, 0.0))
        ],
        _row("vllm", "save", "snapkv", 0.5, 0, 0, 0.0),
        _row("kvpress", "save", "snapkv", 0.5, 0, 0, 1.0),
        _row("vllm", "inplace", "snapkv", 0.5, 0, 0, 1.0),
        _row("vllm", "load", "snapkv", 0.5, 0, 0, 1.0),
        _row("kvpress", "load", "snapkv", 0.5, 0, 0, 0.0),
        _row("vllm", "save", "snapkv", 0.25, 0, 0, 1.0),  # no kvpress at 0.25: unpaired
    ]
    entries = kvpress_compare.side_by_side(rows)
    got = {(e["compact_on"], e["policy"], e["budget"]): e for e in entries}
    assert set(got) == {
        ("save", "kvzip+reconstruct(share=True)", 0.5),
        ("save", "snapkv", 0.5),
        ("load", "snapkv", 0.5),
        ("inplace", "snapkv", 0.5),
    }
    kvzip = got[("save", "kvzip+reconstruct(share=True)", 0.5)]
    assert (kvzip["n"], kvzip["ours"], kvzip["kvpress"], kvzip["ours_ge"]) == (2, 1.0, 1.0, True)
    assert got[("save", "snapkv", 0.5)]["ours_ge"] is False
    assert got[("inplace", "snapkv", 0.5)]["kvpress_on"] == "load"
    table = kvpress_compare.markdown(entries)
    assert "| save / save | snapkv | " in table and "**no**" in table


def test_side_by_side_never_pairs_another_seeds_context() -> None:
    """Our rows of --seed 1 reuse sample indices of kvpress's seed-0 run: they are other
    contexts, so only the seed-0 question pairs."""
    rows = [
        {**_row("vllm", "load", "snapkv", 0.5, 0, 0, 1.0), "seed": 0},
        {**_row("vllm", "load", "snapkv", 0.5, 0, 0, 0.0), "seed": 1},
        _row("kvpress", "load", "snapkv", 0.5, 0, 0, 1.0),
    ]
    (entry,) = kvpress_compare.side_by_side(rows)
    assert (entry["n"], entry["ours"], entry["kvpress"]) == (1, 1.0, 1.0)


def test_report_labels_kvpress_rows_and_never_flags_them(tmp_path: Path) -> None:
    rows = [
        _row("vllm", "none", "none", 1.0, 0, 0, 1.0),
        _row("kvpress", "none", "none", 1.0, 0, 0, 1.0),
        _row("vllm", "save", "snapkv", 0.5, 0, 0, 1.0),
        _row("kvpress", "save", "snapkv", 0.5, 0, 0, 0.0),
    ]
    summary = vllm_report.summarize(rows)
    table = vllm_report.markdown(summary, rows)
    assert "| full cache [kvpress] | none |" in table
    assert "| save | snapkv [kvpress] | 0 | 1 |" in table
    assert "| save | snapkv | 1 | 1 |" in table
    assert "(!)" not in table.split("(!) =")[0]
    assert "ours (vLLM) vs kvpress" in table
    paths = vllm_report.plot(summary, tmp_path, "t")
    assert paths and paths[0].stat().st_size > 0
