"""``examples/serve_vllm.sh``: a real vLLM server with the connector on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.redis_process import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def test_serve_script_answers_one_completion(smollm2_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    env = dict(
        os.environ,
        MODEL=str(smollm2_path),
        PORT=str(free_port()),
        PYTHON=sys.executable,
        LOG=str(log),
    )
    done = subprocess.run(
        [str(ROOT / "examples" / "serve_vllm.sh")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout[-2000:] + log.read_text()[-3000:]
    body = json.loads(done.stdout.strip().splitlines()[-1])
    assert body["choices"][0]["text"].strip()
    assert body["usage"]["completion_tokens"] == 8
    assert "Creating v1 connector with name: LMCompactConnector" in log.read_text()
