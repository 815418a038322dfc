"""The store path under vLLM's multiprocess engine (``vllm serve``'s mode), issue 14.

The scheduler half (engine-core process) and the worker half (worker process) each build
their own store object: the CPU tier is the worker's alone, and the scheduler knows what it
holds only from the worker's reports. Checked with real processes, a tiny random Llama and
a real Redis: the second identical request is served from the store (vLLM counts the
loaded tokens as cached), the metadata never carries a tensor (the connector subclass
raises if it does), and a Redis killed before the third pass gives a recompute with the
first pass's tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.redis_server import redis_server_fixture

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
CHUNK = 128
PROMPT = tiny_prompt_ids(420, seed=9)  # 3 chunks stored, 36 tokens computed
redis_server = redis_server_fixture()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


def _start(model: str, extra: dict[str, Any], pause: bool) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="1")
    command = [
        sys.executable,
        "-m",
        "tests.integration.vllm.multiprocess_run",
        "--model",
        model,
        "--extra",
        json.dumps(extra),
        "--prompt",
        ",".join(map(str, PROMPT)),
    ]
    if pause:
        command.append("--pause")
    return subprocess.Popen(
        command,
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _result(process: subprocess.Popen[str], timeout: float = 480) -> list[dict[str, Any]]:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-4000:]
    line = [row for row in out.splitlines() if row.startswith("{")][-1]
    return list(json.loads(line)["passes"])


def test_cpu_tier_hit_across_processes(tiny_model: str) -> None:
    """Default async save, CPU tier: the repeat right after the first is a store hit."""
    passes = _result(_start(tiny_model, {"policy": "none", "store": {"chunk_size": CHUNK}}, False))
    stored = (len(PROMPT) - 1) // CHUNK * CHUNK
    assert passes[0]["cached"] == 0
    assert passes[1]["cached"] >= stored, passes
    assert passes[2]["cached"] >= stored, passes
    assert passes[0]["tokens"] == passes[1]["tokens"] == passes[2]["tokens"]


def test_redis_tier_hit_then_outage_recomputes(tiny_model: str, redis_server: Any) -> None:
    extra = {
        "policy": "none",
        "store": {"chunk_size": CHUNK, "tiers": ["redis"], "redis_url": redis_server.url},
    }
    process = _start(tiny_model, extra, True)
    assert process.stdout is not None and process.stdin is not None
    for line in process.stdout:  # wait for the pause after two passes
        if line.strip() == "PAUSE":
            break
    else:
        pytest.fail(f"the run ended before its pause (exit {process.wait()})")
    redis_server.kill()
    process.stdin.write("go\n")
    process.stdin.flush()
    passes = _result(process)
    stored = (len(PROMPT) - 1) // CHUNK * CHUNK
    assert passes[0]["cached"] == 0
    assert passes[1]["cached"] >= stored, passes  # served from Redis
    assert passes[0]["tokens"] == passes[1]["tokens"] == passes[2]["tokens"]
