"""Start and stop a private Redis Cluster on loopback for tests (not for production).

Three (or more) ``redis-server --cluster-enabled yes`` primaries on free ports, joined by
``redis-cli --cluster create ... --cluster-replicas 0``. Servers run with
``cluster-require-full-coverage no``, so killing one leaves the others serving their slots
(the setting the store's docs ask for). Each node keeps its ``nodes.conf`` in its own
folder, so a killed node restarted on its port rejoins with its slots (empty: no
persistence).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tests.redis_server import require_redis_server
from tests.support.redis_process import RedisProcess, free_port


class RedisClusterProcess:
    """A Redis Cluster of ``size`` primaries on 127.0.0.1, stopped by PID.

    Args:
        size: number of primaries (3 at least, as ``redis-cli --cluster create`` wants).
        extra_args: more ``redis-server`` options for every node (e.g. maxmemory).
        replicas: replicas per primary (their nodes follow the primaries in :attr:`nodes`
            until a failover promotes one).
    """

    def __init__(
        self, size: int = 3, extra_args: list[str] | None = None, replicas: int = 0
    ) -> None:
        if size < 3:
            raise ValueError(f"a Redis cluster needs at least 3 primaries, got {size}")
        self.cli = shutil.which("redis-cli")
        if self.cli is None:
            raise FileNotFoundError("redis-cli not found on PATH (apt-get install redis-tools)")
        args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "2000",
            "--cluster-require-full-coverage", "no",
            *(extra_args or []),
        ]  # fmt: skip
        # the bus port defaults to port + 10000, past 65535 for a high free port: name one
        self.nodes = [
            RedisProcess(extra_args=[*args, "--cluster-port", str(free_port())])
            for _ in range(size * (1 + replicas))
        ]
        self.replicas = replicas

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL with every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def seed_url(self, index: int = 0) -> str:
        """``redis+cluster://`` URL naming one seed node only (the rest is discovered)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[index].port}"

    def start(self, timeout_s: float = 20.0) -> RedisClusterProcess:
        """Start every node, create the cluster, wait until every node says it is ok."""
        try:
            for node in self.nodes:
                self._start_node(node)
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            assert self.cli is not None
            subprocess.run(
                [self.cli, "--cluster", "create", *addresses,
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=timeout_s,
            )  # fmt: skip
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _start_node(node: RedisProcess, attempts: int = 3) -> None:
        """Start ``node``; when it exits at once (its port or bus port was taken since they
        were picked: another process's outgoing connection can land there), pick both again."""
        for attempt in range(attempts):
            try:
                node.start()
                return
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                node.port = free_port()
                bus = node.extra_args.index("--cluster-port") + 1
                node.extra_args[bus] = str(free_port())

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and knows all slots."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [self._state(n) for n in self.nodes if n.running]
            if all(s == ("ok", 16384) for s in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok after {timeout_s}s: {states}")
            time.sleep(0.05)

    @staticmethod
    def _state(node: RedisProcess) -> tuple[str, int]:
        try:
            info = redis.Redis(port=node.port, socket_timeout=1).cluster("info")
        except redis.exceptions.RedisError:
            return ("unreachable", 0)
        return (str(info["cluster_state"]), int(info["cluster_slots_assigned"]))

    def node_of(self, key: bytes) -> int:
        """Index in :attr:`nodes` of the primary serving ``key``'s slot."""
        live = next(n for n in self.nodes if n.running)
        client = redis.Redis(port=live.port)
        slot = int(client.cluster("keyslot", key))
        for start, end, primary, *_ in client.cluster("slots"):
            if start <= slot <= end:
                return next(i for i, n in enumerate(self.nodes) if n.port == int(primary[1]))
        raise LookupError(f"no node serves slot {slot}")

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (a crash); its slots stay assigned to it."""
        self.nodes[index].kill()

    def restart(self, index: int, timeout_s: float = 20.0) -> None:
        """Start node ``index`` again on its port (it rejoins, empty) and wait until ok."""
        self.nodes[index].start()
        self.wait_ok(timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(OSError):
                node.stop()

    def __enter__(self) -> RedisClusterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redis_cluster_fixture(scope: Any = "function") -> Callable[..., Any]:
    """Build a pytest fixture yielding a started 3-node :class:`RedisClusterProcess`
    (skipped without redis-server, failed instead under ``LMCOMPACT_REQUIRE_REDIS``)."""

    @pytest.fixture(scope=scope)
    def _fixture() -> Iterator[RedisClusterProcess]:
        require_redis_server()
        with RedisClusterProcess() as cluster:
            yield cluster

    return _fixture
