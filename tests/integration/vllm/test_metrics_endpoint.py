"""The connector's counters reach vLLM's Prometheus ``/metrics`` on a real OpenAI server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.redis_process import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
CHUNK = 128
EXTRA = {
    "policy": "snapkv",
    "budget": 0.5,
    "store": {"chunk_size": CHUNK, "tiers": ["cpu"], "async_save": False},
    "release": {"prefill": "auto"},  # each request's computed tail is packed in place too
}
COUNTER = re.compile(r'^vllm:lmcompact_(\w+)_total\{[^}]*engine="0"[^}]*\} (\S+)$', re.MULTILINE)


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def _complete(base: str, prompt: str) -> dict:
    body = json.dumps(
        {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.loads(response.read()))


def counters(base: str) -> dict[str, float]:
    return {name: float(value) for name, value in COUNTER.findall(_get(f"{base}/metrics"))}


def test_metrics_show_store_counters_after_two_requests(smollm2_path: Path, tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    transfer = {
        "kv_connector": "LMCompactConnector",
        "kv_connector_module_path": "connectors.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": EXTRA,
    }
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # one process: the CPU tier serves both halves
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
    )
    command = [
        sys.executable, "-m", "connectors.vllm.launcher", "serve", str(smollm2_path),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--block-size", "32", "--max-model-len", "2048", "--enforce-eager",
        "--no-enable-prefix-caching", "--served-model-name", "m",
        "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                _get(f"{base}/v1/models")
                break
            except OSError:
                assert server.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1)
        before = counters(base)
        assert before.get("stored_chunks", 0) == 0  # nothing counted before a request
        context = " ".join(f"Line {i}: the value of key {i} is {i * 7 % 100}." for i in range(60))
        first = _complete(base, context + " What is the value of key 7?")
        after_first = counters(base)
        second = _complete(base, context + " What is the value of key 13?")
        after_second = counters(base)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    prompt_tokens = first["usage"]["prompt_tokens"]
    chunks = (prompt_tokens - 1) // CHUNK
    print(f"prompt {prompt_tokens} tokens; after one request {after_first}; two {after_second}")
    assert chunks >= 2 and second["usage"]["prompt_tokens"] > chunks * CHUNK
    assert after_first["store_misses"] == 1 and after_first["stored_chunks"] == chunks
    assert 0 < after_first["stored_bytes"] < after_first["stored_full_bytes"]  # compacted
    assert after_second["store_hits"] == 1 and after_second["store_hit_chunks"] == chunks
    assert after_second["loaded_chunks"] == chunks
    assert after_second.get("load_failures", 0) == 0
    assert after_second["packs"] >= after_first["packs"] >= 1
    assert after_second["blocks_released"] > after_first["blocks_released"] > 0
    assert "lmcompact" in log.read_text()
