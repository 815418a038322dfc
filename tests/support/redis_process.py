"""Start and stop a private ``redis-server`` for tests (not for production)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: str, lines: int = 5) -> str:
    """The last ``lines`` lines of a text file, or nothing when it is missing."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class RedisProcess:
    """A ``redis-server`` on 127.0.0.1 without persistence, stopped by its PID.

    Args:
        port: TCP port; None picks a free one.
        executable: path of ``redis-server``; None searches PATH.
        extra_args: more command-line options (e.g. ``["--requirepass", "pw"]``).
    """

    def __init__(
        self,
        port: int | None = None,
        executable: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        exe = executable or shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server not found on PATH (apt-get install redis-server)")
        self.executable = exe
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="lmc-redis-")
        self._log = os.path.join(self._dir, "redis.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        """Whether the server process is alive (started, not killed or stopped)."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        """Launch the server and wait until it answers PING (again, after :meth:`kill`)."""
        os.makedirs(self._dir, exist_ok=True)
        cmd = [
            self.executable,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
            "--protected-mode", "yes",
            "--logfile", self._log,
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                err += _tail(self._log)  # redis says why (e.g. a port in use) in its log
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} did not answer PING in {timeout_s}s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server (simulates a crash) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM the server by PID, SIGKILL if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self.stop()
