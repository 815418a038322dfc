"""The old module paths (package ``connectors``) resolve to the modules under
``lmcompact.vllm`` for one release: the same module objects, the same classes."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("connectors.lmcompact_connector", "lmcompact.vllm.connector"),
        ("connectors.memory.connector", "lmcompact.vllm.connector"),
        ("connectors.memory.config", "lmcompact.vllm.memory.config"),
        ("connectors.vllm_shim", "lmcompact.vllm.vllm_shim"),
        ("connectors.offline", "lmcompact.vllm.offline"),
        ("connectors.memory.workload", "lmcompact.bench.workload"),
    ],
)
def test_old_module_is_the_new_module(old: str, new: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(new)


def test_old_class_names_still_load() -> None:
    from connectors.memory.connector import LMCompactMemoryConnector

    from lmcompact.vllm.connector import LMCompactConnector

    assert issubclass(LMCompactMemoryConnector, LMCompactConnector)
    assert LMCompactMemoryConnector.release_by_default
    assert not LMCompactConnector.release_by_default


def test_a_name_missing_under_the_new_package_is_not_aliased() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("connectors.no_such_module")


def test_old_launcher_path_still_checks_options_before_vllm() -> None:
    bad = json.dumps(
        {
            "kv_connector": "LMCompactConnector",
            "kv_connector_module_path": "connectors.lmcompact_connector",
            "kv_connector_extra_config": {"release": {"prefill": "sideways"}},
        }
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "connectors.vllm_launcher",
            "serve",
            "/no/model",
            "--kv-transfer-config",
            bad,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "release.prefill must be one of" in done.stderr
