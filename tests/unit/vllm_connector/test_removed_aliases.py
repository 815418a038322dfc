"""The aliases of the old layout are gone, and their spellings are refused with a message.

The module paths of the package ``connectors`` (``connectors.lmcompact_connector``,
``connectors.memory.*``, ``connectors.vllm_shim``, ...) and the package ``lmcompact.vllm`` no
longer import; ``LMCompactMemoryConnector`` is gone (``LMCompactConnector`` with a
``"release"`` group); the ``"memory"`` group and flat store keys are refused before vLLM
starts, naming the key.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from connectors.vllm import connector
from connectors.vllm.config import ConnectorConfig

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "old",
    [
        "connectors.lmcompact_connector",
        "connectors.memory.connector",
        "connectors.memory.config",
        "connectors.memory.workload",
        "connectors.vllm_shim",
        "connectors.offline",
        "connectors.vllm_launcher",
        "lmcompact.vllm",
        "lmcompact.vllm.connector",
    ],
)
def test_old_module_paths_do_not_import(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_connectors_package_is_a_plain_package() -> None:
    import connectors

    assert connectors.__file__ is not None
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("connectors")]
    assert connector.__name__ == "connectors.vllm.connector"  # one name per module


def test_one_connector_class() -> None:
    assert not hasattr(connector, "LMCompactMemoryConnector")
    assert "LMCompactConnector" in connector.__all__
    release = ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.5, "release": {}})
    assert release.release is not None  # the old class's default, asked for explicitly
    assert ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.5}).release is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"memory": {"prefill": "pack"}},
            r'"memory" is now the "release" group',
        ),
        (
            {"chunk_size": 256},
            r"\['chunk_size'\] are store options: give them inside the \"store\" group",
        ),
        ({"tiers": ["cpu"], "save": False}, r"\['save', 'tiers'\] are store options"),
    ],
)
def test_old_option_spellings_are_refused(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra(extra)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"memory": {"prefill": "pack"}}, '"memory" is now the "release" group'),
        ({"policy": "snapkv", "chunk_size": 512}, "['chunk_size'] are store options"),
    ],
)
def test_launcher_refuses_old_spellings_before_vllm(extra: dict[str, object], named: str) -> None:
    bad = json.dumps(
        {
            "kv_connector": "LMCompactConnector",
            "kv_connector_module_path": "connectors.vllm.connector",
            "kv_connector_extra_config": extra,
        }
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "connectors.vllm.launcher",
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
    assert "invalid --kv-transfer-config" in done.stderr and named in done.stderr
