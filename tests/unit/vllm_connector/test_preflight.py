"""Connector options are checked before vLLM starts (issue 14: fail in a second)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from connectors.vllm.config import check_transfer_config, transfer_config_arg

ROOT = Path(__file__).resolve().parents[3]


def _transfer(connector: str, extra: dict[str, object]) -> str:
    return json.dumps(
        {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    )


@pytest.mark.parametrize(
    ("connector", "extra", "named"),
    [
        ("LMCompactConnector", {"policy": "nope"}, "nope"),
        ("LMCompactConnector", {"budget": 2.0}, "budget"),
        ("LMCompactConnector", {"tiers": ["disk"]}, "store options"),
        ("LMCompactConnector", {"bogus": 1}, "bogus"),
        (
            "LMCompactConnector",
            {"policy": "none", "release": {"prefill": "pack"}},
            "compacting policy",
        ),
        ("LMCompactConnector", {"store": {"tiers": ["disk"]}}, "store.tiers"),
        ("LMCompactConnector", {"release": {"prefill": "sideways"}}, "release.prefill"),
        ("LMCompactConnector", {"policy": "snapkv", "memory": {"prefill": "pack"}}, "memory"),
    ],
)
def test_bad_options_name_the_key(connector: str, extra: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        check_transfer_config(_transfer(connector, extra))


def test_good_options_pass_and_foreign_connectors_are_left_to_vllm() -> None:
    assert check_transfer_config(_transfer("LMCompactConnector", {"policy": "snapkv"}))
    release = {"policy": "snapkv", "budget": 0.25, "release": {"prefill": "pack"}}
    assert check_transfer_config(_transfer("LMCompactConnector", release))
    # the removed LMCompactMemoryConnector is refused with the name to use instead
    with pytest.raises(ValueError, match='use "LMCompactConnector" with a "release" group'):
        check_transfer_config(_transfer("LMCompactMemoryConnector", release))
    assert not check_transfer_config(_transfer("LMCacheConnectorV1", {"anything": 1}))
    with pytest.raises(ValueError, match="JSON"):
        check_transfer_config("{not json")
    with pytest.raises(ValueError, match="must be a JSON object"):
        check_transfer_config("[]")


def test_transfer_flag_is_found_in_both_spellings() -> None:
    assert transfer_config_arg(["serve", "m", "--kv-transfer-config", "{}"]) == "{}"
    assert transfer_config_arg(["serve", "m", "--kv-transfer-config={}"]) == "{}"
    assert transfer_config_arg(["serve", "m"]) is None


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def test_launcher_rejects_bad_options_before_vllm() -> None:
    bad = _transfer("LMCompactConnector", {"policy": "snapkv", "budget": 1.5})
    done = _run(
        [
            "-m",
            "connectors.vllm.launcher",
            "serve",
            "/no/such/model",
            "--kv-transfer-config",
            bad,
        ]
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "invalid --kv-transfer-config" in done.stderr and "budget" in done.stderr


def test_demo_rejects_an_unknown_policy_without_importing_vllm() -> None:
    code = (
        "import argparse, sys\n"
        "from lmcompact.cli import demo\n"
        "parser = argparse.ArgumentParser(); demo.add_arguments(parser)\n"
        "rc = demo.run(parser.parse_args(['--policy', 'nope']))\n"
        "print('rc', rc, 'vllm_imported', 'vllm' in sys.modules)\n"
    )
    done = _run(["-c", code])
    assert "rc 2 vllm_imported False" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "nope" in done.stderr
