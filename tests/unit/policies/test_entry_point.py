"""A third-party package adds a policy through the ``lmcompact.policies`` entry point."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcompact.policies import (
    ENTRY_POINT_GROUP,
    available_policies,
    get_policy_class,
    make_policy,
    registry,
)
from tests.unit.policies.cases import synthetic_inputs
from tests.unit.policies.test_policy_cases import BUILTIN_NAMES

PLUGIN_SRC = Path(__file__).parent / "plugin_pkg"


def install_plugin(site: Path, entry_points: dict[str, str]) -> None:
    """What ``pip install`` leaves behind, minus the copying: a dist-info with entry points."""
    dist_info = site / "lmc_plugin_demo-0.1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: lmc-plugin-demo\nVersion: 0.1.0\n"
    )
    lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    install_plugin(
        tmp_path,
        {
            "keep_first_demo": "lmc_plugin_demo.policy:KeepFirst",
            "not_a_policy_demo": "lmc_plugin_demo.policy:NotAPolicy",
            "misnamed_demo": "lmc_plugin_demo.policy:KeepFirst",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(PLUGIN_SRC))
    # keep run-time registrations of this test out of the others
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    importlib.invalidate_caches()
    return tmp_path


def test_plugin_is_found_by_name(plugin_site: Path) -> None:
    assert "keep_first_demo" in available_policies()
    assert set(available_policies()) >= BUILTIN_NAMES
    cls = get_policy_class("keep_first_demo")
    assert cls.__module__ == "lmc_plugin_demo.policy"
    plan = make_policy("keep_first_demo", budget=3).plan(synthetic_inputs(2, 2, 10, 4))
    assert all(kept.tolist() == [0, 1, 2] for heads in plan.kept for kept in heads)


def test_broken_plugins_raise_value_errors(plugin_site: Path) -> None:
    with pytest.raises(ValueError, match=r"policy 'not_a_policy_demo' resolves to .*NotAPolicy"):
        get_policy_class("not_a_policy_demo")
    with pytest.raises(
        ValueError,
        match=r"'misnamed_demo' points at a class named "
        r"'keep_first_demo'",
    ):
        get_policy_class("misnamed_demo")


def test_without_the_plugin_the_name_is_unknown() -> None:
    assert "keep_first_demo" not in available_policies()
    with pytest.raises(ValueError, match="unknown policy 'keep_first_demo'"):
        get_policy_class("keep_first_demo")


def test_cli_lists_every_policy_and_the_plugin(tmp_path: Path) -> None:
    install_plugin(tmp_path, {"keep_first_demo": "lmc_plugin_demo.policy:KeepFirst"})
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(tmp_path), str(PLUGIN_SRC)])
    result = subprocess.run(
        [sys.executable, "-m", "lmcompact", "policies", "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    names = [row["name"] for row in rows]
    assert BUILTIN_NAMES | {"keep_first_demo"} == set(names)
    by_name = {row["name"]: row for row in rows}
    assert by_name["h2o"]["params"] == {"budget": "0.5", "recent_ratio": 0.5}
    assert by_name["h2o"]["needs"] == ["CUMULATIVE_SCORES"]
    assert by_name["snapkv"]["phases"] == ["PREFILL"]
    assert by_name["fastgen"]["needs"] == ["WINDOW_ATTENTION", "TOKEN_CLASSES"]


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    from lmcompact.cli import main

    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].startswith("| name | parameters | needs | phases |")
    for name in BUILTIN_NAMES:
        assert any(line.startswith(f"| {name} |") for line in lines), name
    assert "window_size=32, kernel_size=7, pooling='maxpool'" in out
    assert torch.__version__  # torch imported lazily by the policies, not the CLI entry
