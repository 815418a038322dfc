"""Drive a vLLM engine running in its own process (:mod:`tests.support.engine_session`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from tests.support.engine_session import MARK

ROOT = Path(__file__).resolve().parents[2]


class EngineClient:
    """One engine process; requests are answered in order, one at a time.

    Args:
        model: model folder.
        extra: the connector's options (``kv_connector_extra_config``).
        max_model_len: longest request.
        multiprocess: vLLM's multiprocess mode (``vllm serve``'s: engine core and worker in
            processes of their own); False runs the engine inside the session process,
            which starts in a third of the time on a small shared host.
    """

    def __init__(
        self,
        model: str,
        extra: dict[str, Any],
        max_model_len: int = 2048,
        *,
        multiprocess: bool = False,
    ) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "tests.support.engine_session",
                "--model", model,
                "--extra", json.dumps(extra),
                "--max-model-len", str(max_model_len),
                *([] if multiprocess else ["--in-process"]),
            ],
            env=env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )  # fmt: skip
        self._answer()  # ready

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return dict(json.loads(line[len(MARK) :]))
        raise RuntimeError(f"engine exited with {self.proc.wait()}:\n{self.tail()}")

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """``{"tokens", "cached", "finish"}`` of one greedy request."""
        return self._ask({"op": "generate", "prompt": prompt, "max_tokens": max_tokens})

    def redis_keys(self, prompt: list[int]) -> list[str]:
        """The Redis keys this engine stores ``prompt``'s full chunks under."""
        return list(self._ask({"op": "keys", "prompt": prompt})["keys"])

    def tail(self, chars: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read()[-chars:]

    def close(self, timeout_s: float = 60.0) -> None:
        """Ask the engine to quit; kill it (by PID) if it does not in ``timeout_s``."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
