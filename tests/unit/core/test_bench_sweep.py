"""The budget sweep shared by ``lmcompact bench capacity`` and ``bench serve``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from lmcompact.bench.child import child_main
from lmcompact.bench.sweep import bench_command, budget_plans, parse_budgets, publish


def test_parse_budgets() -> None:
    assert parse_budgets(" 0.25, 0.5 ,") == ["0.25", "0.5"]
    for bad, message in [("", "at least one"), ("0.5,1.0", r"\(0, 1\), got 1.0"), ("x", "got x")]:
        with pytest.raises(ValueError, match=message):
            parse_budgets(bad)


def test_budget_plans_baseline_first_then_one_pack_per_budget() -> None:
    plans = budget_plans("snapkv", ["0.25", "0.5"], 16, {"prefill": "pack"})
    assert [name for name, _ in plans] == ["baseline", "0.25", "0.5"]
    assert plans[0][1] is None
    assert plans[2][1] == {
        "policy": "snapkv",
        "budget": 0.5,
        "window": 16,
        "store": False,
        "release": {"prefill": "pack"},
    }
    from connectors.vllm.config import ConnectorConfig  # the one connector takes the plan as is

    config = ConnectorConfig.from_extra(plans[2][1])
    assert config.release is not None and not config.store.enabled


def test_per_head_plans_pack_in_place_with_dense_per_head_counts() -> None:
    from connectors.vllm.config import ConnectorConfig
    from lmcompact.bench.serve import per_head_plans

    memory = {"prefill": "pack"}
    plans = per_head_plans("adakv", 1.5, ["0.25"], 16, memory, {"cuda_graphs": "full"})
    assert [name for name, _ in plans] == ["0.25 adakv per-head"]
    extra = plans[0][1]
    assert extra["release"] == {"prefill": "pack", "per_head": {"slack": 1.5}}
    assert memory == {"prefill": "pack"}  # the uniform plans' group is left alone
    config = ConnectorConfig.from_extra(extra)
    assert config.release is not None and config.release.per_head_layer_slack() == 1.0


def test_bench_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lmcompact", "bench", "serve", "--quick"])
    assert bench_command("serve") == "lmcompact bench serve --quick"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--quick"])
    assert bench_command("serve") == "lmcompact bench serve --quick"


def test_publish_writes_json_and_plot_next_to_it(tmp_path: Path) -> None:
    drawn: list[Path] = []
    args = argparse.Namespace(json=str(tmp_path / "r.json"), plot=None)
    publish(args, {"a": 1}, drawn.append)
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
    assert drawn == [tmp_path / "r.png"]
    publish(argparse.Namespace(json="-", plot=None), {"a": 1}, drawn.append)
    assert len(drawn) == 1  # stdout only: no plot


def test_child_main_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"workload": {"n": 2}, "extra": None, "out": str(out)}))
    assert child_main(str(spec), lambda w, e: {"n": w["n"] * 2, "extra": e}) == 0
    assert json.loads(out.read_text()) == {"n": 4, "extra": None}
