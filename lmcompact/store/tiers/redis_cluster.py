"""A Redis Cluster (or Valkey cluster) as the Redis tier's backend: commands routed by slot.

URL: ``redis+cluster://[[user]:password@]host:port[,host:port...]`` (``rediss+cluster://``
for TLS): one or more seed nodes; the rest of the cluster is discovered from them by
redis-py's :class:`~redis.cluster.RedisCluster`, which this module uses for the slot map
only. Data goes to each primary through a plain client of its own (one pool per node)::

    batch of commands --slot of each key--> node A: SET k1 ..., SET k4 ...   (one write)
                                            node B: SET k2 ...               (one write)
                                            node C: SET k3 ..., SET k5 ...   (one write)
    then the replies are read node by node, so the nodes work at the same time.

Every chunk key is its own slot (no hash tags): a request's chunks spread over the nodes,
so loading a long prefix reads from all of them at once. Nothing needs a request's chunks
together: each chunk is fetched, checked and refused on its own, and a missing one ends
the stored prefix there (the engine recomputes from it). Keeping tensor-parallel slices
of one chunk on one node would not help either: a rank loads only its own slice.

Per node, faults are handled as by the single-server tier (:class:`RedisNode`): a node
that is down answers misses for its keys and skips its saves (counted, logged once) and
is probed with backoff. A fault or a ``MOVED`` reply marks the slot map stale;
it is reloaded from the cluster before the next batch (rate limited), which follows a
failover to a replica, and moved commands are sent once more to their new node (an
``ASK`` reply, a slot half migrated, is a miss).
Servers should run with ``cluster-require-full-coverage no``, else the live nodes refuse
every command while one is down (those refusals are misses too, not errors).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from lmcompact.store.metrics import TierMetrics
from lmcompact.store.tiers.redis_node import DOWN, FAULTS, RedisNode
from lmcompact.store.tiers.redis_url import parse_cluster_url
from lmcompact.store.tiers.resp import Command

logger = logging.getLogger(__name__)


class ClusterLink:
    """Routes batches of keyed commands to the cluster's primaries, one write per node.

    Args:
        url: ``redis+cluster://`` URL (see :mod:`lmcompact.store.tiers.redis_url`).
        stats: the tier's counters.
        socket_timeout_s: per-operation socket timeout of every node.
        backoff_initial_s: first delay before probing a node (or the cluster) again.
        backoff_max_s: cap of that delay.
    """

    def __init__(
        self,
        url: str,
        stats: TierMetrics,
        *,
        socket_timeout_s: float,
        backoff_initial_s: float,
        backoff_max_s: float,
    ) -> None:
        self.address = parse_cluster_url(url)
        self.name = self.address.redacted()
        self.stats = stats
        self._connection: dict[str, Any] = {
            "username": self.address.username,
            "password": self.address.password,
            "ssl": self.address.tls,
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
            "health_check_interval": 0,
            "retry": Retry(NoBackoff(), 0),  # faults are handled per node; fail fast here
        }
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._backoff = backoff_initial_s
        self._client: RedisCluster | None = None
        self._stale = True
        self._map_ok = True  # whether the last slot map load worked (a warning on change)
        self._refresh_at = 0.0
        self._nodes: dict[str, RedisNode] = {}
        self._lock = threading.Lock()
        if self._slot_map() is None:
            logger.info("redis cluster %s starts unreachable; will retry", self.name)

    @property
    def healthy(self) -> bool:
        return self._client is not None and all(n.healthy for n in self._nodes.values())

    def nodes_down(self) -> list[str]:
        """Names of the nodes now served as misses."""
        return sorted(name for name, node in self._nodes.items() if not node.healthy)

    def _mark_stale(self) -> None:
        self._stale = True

    def _slot_map(self) -> RedisCluster | None:
        """The cluster client, its slot map reloaded first when it is stale (at most once
        per backoff delay); None while no seed has answered yet."""
        if not self._stale:
            return self._client
        with self._lock:
            if not self._stale or time.monotonic() < self._refresh_at:
                return self._client
            self._refresh_at = time.monotonic() + self._backoff
        try:
            if self._client is None:
                self._client = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in self.address.seeds],
                    require_full_coverage=False,
                    **self._connection,
                )
            else:
                self._client.nodes_manager.initialize()
        except (
            *FAULTS,
            redis.exceptions.RedisError,
            redis.exceptions.RedisClusterException,
        ) as exc:
            with self._lock:
                self.stats.add(errors=1)
                if self._map_ok:
                    logger.warning(
                        "redis cluster %s: no slot map (%s: %s); serving misses, retrying",
                        self.name,
                        type(exc).__name__,
                        exc,
                    )
                self._map_ok = False
                self._backoff = min(self._backoff * 2, self._backoff_max)
            return self._client
        primaries = {node.name for node in self._client.get_primaries()}
        with self._lock:
            for name in set(self._nodes) - primaries:  # failed over or removed: forget it
                self._nodes.pop(name).close()
            self._stale = False
            self._backoff = self._backoff_initial
            if not self._map_ok:
                logger.info("redis cluster %s: slot map loaded again", self.name)
            self._map_ok = True
        return self._client

    def _node(self, cluster: RedisCluster, key: bytes) -> RedisNode | None:
        """The node serving ``key``'s slot (a client of its own per node), or None."""
        try:
            target = cluster.nodes_manager.get_node_from_slot(key_slot(key))
        except redis.exceptions.RedisClusterException:  # slot not covered now
            self._mark_stale()
            return None
        node = self._nodes.get(target.name)
        if node is None:
            with self._lock:
                node = self._nodes.get(target.name)
                if node is None:
                    client = redis.Redis(host=target.host, port=target.port, **self._connection)
                    node = RedisNode(
                        client,
                        target.name,
                        self.stats,
                        backoff_initial_s=self._backoff_initial,
                        backoff_max_s=self._backoff_max,
                        on_fault=self._mark_stale,
                    )
                    self._nodes[target.name] = node
        return node

    def run(self, commands: Sequence[Command], *, resend: bool = True) -> list[Any]:
        """One reply per command: its server's, an error reply as its exception instance,
        or :data:`DOWN` when its node could not be reached (never raises for faults)."""
        replies: list[Any] = [DOWN] * len(commands)
        cluster = self._slot_map()
        if cluster is None or not commands:
            return replies
        groups: dict[str, tuple[RedisNode, list[int]]] = {}
        for i, (key, _) in enumerate(commands):
            node = self._node(cluster, key)
            if node is not None:
                groups.setdefault(node.name, (node, []))[1].append(i)
        sent = []
        for node, idx in groups.values():
            packed = [buf for i in idx for buf in commands[i][1]]
            sent.append((node, idx, node.send(packed)))
        for node, idx, conn in sent:
            for i, reply in zip(idx, node.receive(conn, len(idx)), strict=True):
                replies[i] = reply
        moved = [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.MovedError)]
        if moved:  # slots changed owner (resharding, failover): reload the map, resend once
            self._mark_stale()
            with self._lock:
                self._refresh_at = 0.0
            if resend:
                again = self.run([commands[i] for i in moved], resend=False)
                for i, reply in zip(moved, again, strict=True):
                    replies[i] = reply
        return replies

    def close(self) -> None:
        for node in self._nodes.values():
            node.close()
        if self._client is not None:
            with contextlib.suppress(*FAULTS):
                self._client.close()
