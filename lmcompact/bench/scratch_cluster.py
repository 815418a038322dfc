"""A throwaway Redis Cluster on loopback for ``lmcompact bench store --redis-cluster N``.

N ``redis-server --cluster-enabled yes`` primaries on free 127.0.0.1 ports (no persistence,
``cluster-require-full-coverage no``, each node's files in one temporary folder), joined by
``redis-cli --cluster create ... --cluster-replicas 0``; stopped by PID on exit.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _cluster_ok(port: int) -> bool:
    """Whether the node on ``port`` answers ``CLUSTER INFO`` with state ok."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"CLUSTER INFO\r\n")
            return b"cluster_state:ok" in conn.recv(4096)
    except OSError:
        return False


def _wait(ports: list[int], procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait until every node answers PING."""
    deadline = time.monotonic() + timeout_s
    for port, proc in zip(ports, procs, strict=True):
        while not _answers(port):
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {port} did not answer PING")
            time.sleep(0.02)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def scratch_redis_cluster(nodes: int = 3, timeout_s: float = 20.0) -> Iterator[str]:
    """Start a private cluster of ``nodes`` primaries; yields its ``redis+cluster://`` URL.

    Raises:
        ValueError: fewer than 3 nodes (``redis-cli --cluster create`` wants 3).
        FileNotFoundError: no ``redis-server`` or ``redis-cli`` on PATH.
        RuntimeError, TimeoutError: a node exits, or the cluster is not ok in ``timeout_s``.
    """
    if nodes < 3:
        raise ValueError(f"a Redis cluster needs at least 3 primaries, got {nodes}")
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise FileNotFoundError("redis-server / redis-cli not found on PATH (apt-get install)")
    ports = [free_port() for _ in range(nodes)]
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="lmc-bench-cluster-") as folder:
        try:
            for port in ports:
                node_dir = Path(folder) / str(port)
                node_dir.mkdir()
                command = [
                    server, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                    "--appendonly", "no", "--dir", str(node_dir),
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-require-full-coverage", "no",
                    # the bus port defaults to port + 10000, past 65535 for a high free port
                    "--cluster-port", str(free_port()),
                ]  # fmt: skip
                procs.append(
                    subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )
            _wait(ports, procs, timeout_s)
            addresses = [f"127.0.0.1:{p}" for p in ports]
            subprocess.run(
                [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                 "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=timeout_s,
            )  # fmt: skip
            deadline = time.monotonic() + timeout_s
            while not all(_cluster_ok(p) for p in ports):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster on ports {ports} not ok in {timeout_s}s")
                time.sleep(0.05)
            yield "redis+cluster://" + ",".join(addresses)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
