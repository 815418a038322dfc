"""One Redis server as the Redis tier sees it: a pooled client, its health and its backoff.

A batch of packed commands goes out in one write and its replies are read after it (one
round trip). The two halves are separate (:meth:`RedisNode.send`, :meth:`RedisNode.receive`)
so that a cluster can write every node's batch before it reads any reply: the nodes then
work at the same time.

A connection fault (refused, reset, timed out) turns the node unhealthy: its commands are
answered with :data:`DOWN` without touching the network, one warning is logged, and a PING
is retried with exponential backoff until it answers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.connection import Connection

from lmcompact.store.metrics import TierMetrics
from lmcompact.store.tiers.resp import (
    Buffer,
    Command,
    read_replies,
    send_packed,
    take_connection,
)

logger = logging.getLogger(__name__)

FAULTS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
"""Exceptions that mean "this server cannot be reached now" (not "it refused a command")."""


class _Down:
    def __repr__(self) -> str:
        return "DOWN"


DOWN: Any = _Down()
"""The reply of a command that was not run because its server is unreachable."""


class RedisNode:
    """A Redis server behind ``client``, with health tracking and reconnect backoff.

    Args:
        client: the server's client (its pool is used; the node does its own retries).
        name: how logs name the server (no password in it).
        stats: the tier's counters (``errors`` counts faults).
        backoff_initial_s: first reconnect delay; doubled after each failure.
        backoff_max_s: cap of the reconnect delay.
        on_fault: called after each fault (a cluster refreshes its slot map then).
    """

    def __init__(
        self,
        client: redis.Redis,
        name: str,
        stats: TierMetrics,
        *,
        backoff_initial_s: float,
        backoff_max_s: float,
        on_fault: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.name = name
        self.stats = stats
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._backoff = backoff_initial_s
        self._on_fault = on_fault
        self._healthy = True
        self._retry_at = 0.0
        self._lock = threading.Lock()

    @property
    def healthy(self) -> bool:
        return self._healthy

    def fault(self, exc: BaseException) -> None:
        """Count a fault, turn unhealthy (warning once) and schedule the next probe."""
        with self._lock:
            self.stats.add(errors=1)
            if self._healthy:
                logger.warning(
                    "redis node %s unreachable (%s: %s); serving misses, retrying in %.2fs",
                    self.name,
                    type(exc).__name__,
                    exc,
                    self._backoff,
                )
            else:
                self._backoff = min(self._backoff * 2, self._backoff_max)
            self._healthy = False
            self._retry_at = time.monotonic() + self._backoff
        if self._on_fault is not None:
            self._on_fault()

    def available(self) -> bool:
        """Whether to talk to the server now; when unhealthy, PING once the backoff has passed."""
        if self._healthy:
            return True
        with self._lock:
            if self._healthy:
                return True
            if time.monotonic() < self._retry_at:
                return False
            self._retry_at = time.monotonic() + self._backoff  # one prober at a time
        try:
            self.client.connection_pool.disconnect()
            self.client.ping()
        except FAULTS as exc:
            self.fault(exc)
            return False
        with self._lock:
            self._healthy = True
            self._backoff = self._backoff_initial
        logger.info("redis node %s reachable again", self.name)
        return True

    def call(self, fn: Callable[[redis.Redis], Any], default: Any) -> Any:
        """``fn(client)``, or ``default`` when the server is down or fails (never raises)."""
        if not self.available():
            return default
        try:
            return fn(self.client)
        except FAULTS as exc:
            self.fault(exc)
            return default
        except redis.exceptions.RedisError as exc:  # e.g. OOM from maxmemory: not a fault
            self.stats.add(errors=1)
            logger.warning("redis node %s error: %s", self.name, exc)
            return default

    def send(self, packed: Sequence[Buffer]) -> Connection | None:
        """Write a batch; the connection to read its replies from, or None (down, or failed)."""
        if not self.available():
            return None
        try:
            conn = take_connection(self.client)
        except FAULTS as exc:
            self.fault(exc)
            return None
        try:
            send_packed(conn, packed)
        except FAULTS as exc:
            self._drop(conn)
            self.fault(exc)
            return None
        except BaseException:
            self._drop(conn)
            raise
        return conn

    def receive(self, conn: Connection | None, num_replies: int) -> list[Any]:
        """The replies of a batch :meth:`send` wrote on ``conn`` (error replies as exception
        instances); ``num_replies`` x :data:`DOWN` when it was not sent or the read failed."""
        if conn is None:
            return [DOWN] * num_replies
        try:
            replies = read_replies(conn, num_replies)
        except FAULTS as exc:
            self._drop(conn)
            self.fault(exc)
            return [DOWN] * num_replies
        except BaseException:
            self._drop(conn)  # it may hold the rest of the replies
            raise
        self.client.connection_pool.release(conn)
        return replies

    def execute(self, packed: Sequence[Buffer], num_replies: int) -> list[Any]:
        """:meth:`send` then :meth:`receive`: one round trip."""
        return self.receive(self.send(packed), num_replies)

    def run(self, commands: Sequence[Command]) -> list[Any]:
        """One reply per command (as :meth:`receive` gives them), in one round trip."""
        return self.execute([buf for _, parts in commands for buf in parts], len(commands))

    def nodes_down(self) -> list[str]:
        """``[name]`` while the server is served as misses, else empty."""
        return [] if self._healthy else [self.name]

    def _drop(self, conn: Connection) -> None:
        """Close a connection that may hold half a reply, and give it back to its pool."""
        conn.disconnect()
        self.client.connection_pool.release(conn)

    def close(self) -> None:
        with contextlib.suppress(*FAULTS):
            self.client.close()
