"""``--engine vllm`` harness pieces without an engine: contexts, config, summary, plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmcompact.eval import tasks, vllm_report
from lmcompact.eval.text import text_stream
from lmcompact.eval.vllm_runner import VllmEvalConfig, build_cases, cells
from tests.unit.hf.test_eval_pieces import CharTokenizer


def test_stored_context_has_exact_length_and_one_question_per_fact() -> None:
    tok = CharTokenizer()
    stored = tasks.build_stored_context(tok, 4000, 3, [0.1, 0.5, 0.9], text_stream(3))
    assert len(stored.context_ids) == 4000
    text = tok.decode(stored.context_ids)
    places = [text.index(f.sentence) for f in stored.needles]
    assert places == sorted(places) and places[0] < 800 and places[-1] > 3000
    assert len({(f.noun, f.owner) for f in stored.needles}) == 3
    for i, fact in enumerate(stored.needles):
        prompt = tok.decode(stored.prompt(i))
        assert prompt.startswith(text)
        assert prompt.endswith(f"{fact.question} {fact.answer_prefix}")
        assert fact.passkey in fact.sentence and fact.passkey not in fact.question
    again = tasks.build_stored_context(tok, 4000, 3, [0.1, 0.5, 0.9], text_stream(3))
    assert again == stored


def test_stored_context_rejects_what_cannot_fit() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        tasks.build_stored_context(CharTokenizer(), 120, 0, [0.2, 0.8], text_stream(0))
    with pytest.raises(ValueError, match="at most 8"):
        tasks.make_facts(0, [0.5] * 9)


def test_cases_per_task() -> None:
    config = VllmEvalConfig(
        contexts=[600], chunk_size=256, samples=2, tasks=["multi_needle", "needle"]
    )
    cases = build_cases(CharTokenizer(), config, 600)
    multi = [c for c in cases if c.task == "multi_needle"]
    single = [c for c in cases if c.task == "needle"]
    assert len(multi) == 2 and all(len(c.stored.needles) == 3 for c in multi)
    assert len(single) == 6 and all(len(c.stored.needles) == 1 for c in single)
    assert sorted(c.stored.needles[0].depth for c in single) == [0.1, 0.1, 0.5, 0.5, 0.9, 0.9]
    assert next(iter(cells(config))) == ("none", "none", 1.0)
    # the default mode once per budget (no policy), 4 modes x 2 budgets, but "both" only
    # below its store budget (0.5): 0.25 alone
    assert len(list(cells(config))) == 1 + 2 + 3 * 2 + 1
    assert ("default", "auto", 0.25) in set(cells(config))
    assert ("both", "snapkv", 0.5) not in set(cells(config))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tasks": ["ppl"]}, "unknown tasks"),
        ({"modes": ["later"]}, "--compact-on"),
        ({"budgets": [1.0]}, r"\(0, 1\)"),
        ({"contexts": [256]}, ">= 512"),
        ({"depths": [1.5]}, r"\[0, 1\]"),
    ],
)
def test_config_is_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VllmEvalConfig(**kwargs)


def _row(mode: str, policy: str, budget: float, accuracy: float, **extra: Any) -> dict[str, Any]:
    honest = {
        "none": {},
        "save": {"hit_chunks": 8, "expected_hit_chunks": 8, "holes_adopted": 1},
        "load": {"hit_chunks": 8, "expected_hit_chunks": 8, "packs": 1, "blocks_released": 48},
        "inplace": {"packs": 1, "blocks_released": 48},
    }[mode]
    return {
        "engine": "vllm",
        "model": "smollm2",
        "task": "multi_needle",
        "context": 2048,
        "compact_on": mode,
        "policy": policy,
        "budget": budget,
        "accuracy": accuracy,
        "seconds": 1.0,
        "cell_s": 10.0,
        **honest,
        **extra,
    }


def test_summary_flags_misses_and_draws_one_panel_per_mode(tmp_path: Path) -> None:
    rows = [
        _row("none", "none", 1.0, 1.0),
        _row("none", "none", 1.0, 0.0),
        _row("save", "snapkv", 0.25, 0.0),
        _row("save", "snapkv", 0.25, 1.0, hit_chunks=0),  # a miss must not pass
        _row("load", "snapkv", 0.25, 1.0),
        _row("load", "snapkv", 0.25, 1.0),
        _row("inplace", "snapkv", 0.25, 1.0, packs=0),  # not compacted
        {**_row("inplace", "knorm", 0.5, 0.0), "task": None, "error": "refused: reason"},
    ]
    summary = vllm_report.summarize(rows)
    by = {(r["compact_on"], r["policy"]): r for r in summary}
    assert by[("none", "none")]["accuracy"] == 0.5 and by[("none", "none")]["n"] == 2
    assert by[("save", "snapkv")]["store_ok"] is False
    assert by[("load", "snapkv")]["store_ok"] is True
    assert by[("inplace", "snapkv")]["store_ok"] is False
    table = vllm_report.markdown(summary)
    assert "| load | snapkv | 1 | 2 |" in table
    assert "| save | snapkv | 0.5 (!) |" in table
    assert "refused: reason" in table
    paths = vllm_report.plot(summary, tmp_path, "t")
    assert [p.name for p in paths] == ["t_multi_needle.png"] and paths[0].stat().st_size > 0


def test_merge_keeps_a_repeated_baseline_once(tmp_path: Path) -> None:
    first = [
        {**_row("none", "none", 1.0, 1.0), "sample": 0, "question": 0},
        {**_row("save", "snapkv", 0.25, 0.0), "sample": 0, "question": 0},
    ]
    second = [
        {**_row("none", "none", 1.0, 1.0), "sample": 0, "question": 0},
        {**_row("save", "kvzip", 0.25, 1.0), "sample": 0, "question": 0},
    ]
    merged = vllm_report.merge(
        [{"command": "a", "samples": first}, {"command": "b", "samples": second}]
    )
    assert merged["commands"] == ["a", "b"]
    assert len(merged["samples"]) == 3
    assert {(r["policy"], r["n"]) for r in merged["results"]} == {
        ("none", 1),
        ("snapkv", 1),
        ("kvzip", 1),
    }


def test_merge_keeps_every_depth_of_a_needle_sample() -> None:
    """``needle`` builds one context per depth, each asked question 0: all are rows."""
    rows = [
        {**_row("inplace", "snapkv", 0.25, 1.0), "task": "needle", "sample": 0, "question": 0}
        | {"depth": depth}
        for depth in (0.1, 0.5, 0.9)
    ]
    merged = vllm_report.merge([{"command": "a", "samples": rows}])
    assert len(merged["samples"]) == 3 and merged["results"][0]["n"] == 3


def test_merge_counts_the_contexts_of_another_seed() -> None:
    """Two runs with --seed 0 and 1 ask different contexts under the same sample index: both
    count; a later merge of the merge keeps them apart too."""
    row = {**_row("save", "self_info", 0.25, 1.0), "sample": 0, "question": 0, "depth": 0.1}
    runs = [{"command": f"s{seed}", "config": {"seed": seed}, "samples": [row]} for seed in (0, 1)]
    merged = vllm_report.merge(runs)
    assert [r["seed"] for r in merged["samples"]] == [0, 1]
    assert merged["results"][0]["n"] == 2
    assert len(vllm_report.merge([merged, runs[1]])["samples"]) == 2


def test_relabel_renames_our_rows_before_the_merge(tmp_path: Path) -> None:
    """An old default's rows get an explicit label: they stay apart from a new run's rows of
    the same (sample, question), and kvpress's rows keep theirs."""
    import json

    old = [{**_row("inplace", "snapkv", 0.25, 0.0), "sample": 0, "question": 0}]
    old.append({**old[0], "engine": "kvpress", "accuracy": 1.0})
    new = [{**_row("inplace", "snapkv(kernel_size=15)", 0.25, 1.0), "sample": 0, "question": 0}]
    paths = []
    for name, rows in (("old", old), ("new", new)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"command": name, "samples": rows}))
        paths.append(str(path))
    out = tmp_path / "merged.json"
    relabel = ["--relabel", "snapkv=snapkv(kernel_size=7)"]
    assert vllm_report.main([*paths, "--json", str(out), *relabel]) == 0
    merged = json.loads(out.read_text())
    labels = {(r["engine"], r["policy"]) for r in merged["samples"]}
    assert labels == {
        ("vllm", "snapkv(kernel_size=7)"),
        ("kvpress", "snapkv"),
        ("vllm", "snapkv(kernel_size=15)"),
    }
    assert merged["relabelled"] == ["relabelled 1 rows: snapkv -> snapkv(kernel_size=7)"]
    with pytest.raises(SystemExit):
        vllm_report.main([*paths, "--json", str(out), "--relabel", "snapkv"])
    assert vllm_report.split_relabel("s(a=1)=s(a=1,b=2)") == ("s(a=1)", "s(a=1,b=2)")
    assert vllm_report.split_relabel("s(a=1)") == ("", "")


def test_save_mode_of_kvzip_uses_the_reconstruction_request() -> None:
    from lmcompact.eval.vllm_runner import connector_extra, policy_label, uses_reconstruction

    config = VllmEvalConfig(
        policies=["kvzip", "snapkv"], policy_params={"kvzip": {"share": True, "kernel_size": 15}}
    )
    assert uses_reconstruction("save", "kvzip", config)
    assert not uses_reconstruction("save", "snapkv", config)
    assert not uses_reconstruction("load", "kvzip", config)
    assert not uses_reconstruction("save", "kvzip", VllmEvalConfig(reconstruct=False))
    assert policy_label("kvzip", config, True) == "kvzip+reconstruct(kernel_size=15,share=True)"
    assert policy_label("snapkv", config, False) == "snapkv"
    wide = VllmEvalConfig(policies=["snapkv"], chunk_size=1024)
    assert policy_label("snapkv", wide, False) == "snapkv@chunk1024"
    assert connector_extra("save", "snapkv", 0.5, wide, "ns")["store"]["chunk_size"] == 1024
    extra = connector_extra("save", "kvzip", 0.5, config, "ns")
    assert extra["policy_params"] == {"share": True, "kernel_size": 15}
    assert "policy_params" not in connector_extra("save", "snapkv", 0.5, config, "ns")
    with pytest.raises(ValueError, match="not among the policies"):
        VllmEvalConfig(policies=["snapkv"], policy_params={"kvzip": {}})


def test_merge_accepts_an_earlier_merge() -> None:
    row = {
        "model": "m",
        "task": "multi_needle",
        "context": 2048,
        "compact_on": "save",
        "policy": "kvzip",
        "budget": 0.5,
        "sample": 0,
        "question": 0,
        "accuracy": 1.0,
        "seconds": 1.0,
    }
    first = vllm_report.merge([{"command": "a", "config": {}, "samples": [row]}])
    second = vllm_report.merge([first, {"command": "b", "config": {}, "samples": [row]}])
    assert second["commands"] == ["a", "b"]
    assert len(second["samples"]) == 1


def test_save_mode_of_self_info_uses_the_surprisal_requests() -> None:
    from lmcompact.eval.vllm_runner import uses_reconstruction, uses_surprisal

    engine = VllmEvalConfig(policies=["self_info", "kvzip", "snapkv"])
    assert not uses_surprisal("save", "self_info", engine)  # the engine scores it itself
    config = VllmEvalConfig(policies=["self_info", "kvzip", "snapkv"], client_scores=True)
    assert uses_surprisal("save", "self_info", config)
    assert not uses_reconstruction("save", "self_info", config)
    assert not uses_surprisal("load", "self_info", config)
    assert not uses_surprisal("save", "kvzip", config)
    assert not uses_surprisal("save", "snapkv", config)


@pytest.mark.skipif(
    not __import__("pathlib").Path("/usr/share/common-licenses").is_dir(),
    reason="no /usr/share/common-licenses on this machine",
)
def test_licenses_haystack_is_a_second_natural_text() -> None:
    from lmcompact.eval.text import haystack_text

    text = haystack_text("licenses", 0)
    assert len(text) > 50_000 and "\n\n" in text and "License" in text
    assert haystack_text("licenses", 1) != text  # the seed picks the start
    assert haystack_text("pydoc", 0) != text
    with pytest.raises(ValueError, match="pydoc, licenses"):
        haystack_text("filler", 0)
    with pytest.raises(ValueError, match="unknown haystack text"):
        VllmEvalConfig(text="filler")
