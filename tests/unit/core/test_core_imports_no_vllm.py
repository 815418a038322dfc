"""No module of ``lmcompact`` imports vLLM or the connectors (``connectors``) at import time.

Imported in a fresh interpreter, module by module (the engine-free core and the apps alike:
``bench``, ``eval`` and ``cli`` import ``connectors.vllm`` lazily, inside the functions that
drive an engine): a module after whose import vLLM or a connector module is loaded fails the
test with its name. ``tests/unit/core/test_vllm_imports.py`` reads the import statements
themselves, lazy ones included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import importlib, json, pkgutil, sys

import lmcompact

def walk(path, prefix):
    for info in pkgutil.iter_modules(path, prefix):
        if info.name.endswith("__main__"):
            continue
        yield info.name
        if info.ispkg:
            yield from walk(importlib.import_module(info.name).__path__, info.name + ".")

names, culprit = [], None
for name in walk(lmcompact.__path__, "lmcompact."):
    importlib.import_module(name)
    names.append(name)
    engine = ("vllm", "connectors")
    if any(m.split(".")[0] in engine for m in sys.modules):
        culprit = name
        break
print(json.dumps({"modules": len(names), "culprit": culprit}))
"""


def test_core_modules_import_without_vllm() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["culprit"] is None, f"{result['culprit']} imports vLLM or the connector"
    assert result["modules"] > 50  # the walk reached the whole core
