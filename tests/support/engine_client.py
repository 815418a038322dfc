"""Drive a vLLM engine running in its own process (:mod:`tests.support.engine_session`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
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
        self._ready = False  # engines started together load their models at the same time

    def wait_ready(self) -> None:
        """Wait until the engine answers (its model loaded); requests do it first."""
        if not self._ready:
            self._answer()
            self._ready = True

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return dict(json.loads(line[len(MARK) :]))
        raise RuntimeError(f"engine exited with {self.proc.wait()}:\n{self.tail()}")

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self.wait_ready()
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

    def quit(self) -> None:
        """Ask the engine to quit (it drains its saves and shuts down); returns at once."""
        stdin = self.proc.stdin
        if self.proc.poll() is None and stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):
                stdin.write(json.dumps({"op": "quit"}) + "\n")
                stdin.close()

    def close(self, timeout_s: float = 60.0) -> None:
        """:meth:`quit`, then wait; kill it (by PID) if it has not exited in ``timeout_s``."""
        self.quit()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def engines(count: int, model: str, extra: dict[str, Any]) -> Iterator[list[EngineClient]]:
    """``count`` engines of one configuration, started together and shut down together."""
    clients: list[EngineClient] = []
    try:
        clients = [EngineClient(model, extra) for _ in range(count)]
        yield clients
    finally:
        for client in clients:
            client.quit()
        for client in clients:
            client.close()
