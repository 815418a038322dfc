"""Redis tier: one key per chunk, value = the codec's bytes, written with a single SET.

A batch of chunks is written and read in one round trip per server (pipelined ``SET`` /
``GET``). Values are written from the codec's buffers (frame head plus views of the chunk's
tensors, see :mod:`lmcompact.store.tiers.resp`) and decoded in place over the bytes
redis-py received, so the payload is copied by neither side.

The backend is one server (``redis://``, :class:`~lmcompact.store.tiers.redis_node.RedisNode`)
or a cluster (``redis+cluster://``, :class:`~lmcompact.store.tiers.redis_cluster.ClusterLink`,
keys routed by slot, one pipelined batch per node); keys, values and checks are the same.

A SET is atomic, so a reader sees a whole value or none; anything else that can go wrong
with a value (damage, another engine's namespace, an old format) is caught by the codec,
counted as ``rejected`` and the key deleted. When a server is unreachable (at start or
mid-run) its keys are misses and its saves are skipped, without touching the network, one
warning is logged, and a PING is retried with exponential backoff until it answers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.codec import ChunkCodec, CorruptEntryError, EncodedValue
from lmcompact.store.keys import ChunkKey
from lmcompact.store.tiers.base import StorageTier
from lmcompact.store.tiers.redis_cluster import ClusterLink
from lmcompact.store.tiers.redis_node import RedisNode
from lmcompact.store.tiers.redis_url import check_redis_url, is_cluster_url
from lmcompact.store.tiers.resp import Command, pack_command, pack_set

logger = logging.getLogger(__name__)


class RedisTier(StorageTier):
    """Chunks in Redis (one server or a cluster), encoded by a :class:`ChunkCodec`.

    Args:
        url: ``redis://[:password@]host:port/db``, ``rediss://`` (TLS), or a cluster:
            ``redis+cluster://[:password@]host:port[,host:port...]`` (``rediss+cluster://``).
        codec: the engine's codec (its namespace guards every value read).
        key_prefix: prefix of every Redis key (``<prefix>:<namespace>:<key hex>``).
        ttl_s: expire entries after this many seconds; None keeps them.
        socket_timeout_s: per-operation socket timeout.
        backoff_initial_s: first reconnect delay; doubled after each failure.
        backoff_max_s: cap of the reconnect delay.
    """

    name = "redis"
    holds_encoded = True

    def __init__(
        self,
        url: str,
        codec: ChunkCodec,
        *,
        key_prefix: str = "lmc",
        ttl_s: float | None = None,
        socket_timeout_s: float = 2.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        super().__init__()
        check_redis_url(url, "redis url")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s!r}")
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError(
                f"need 0 < backoff_initial_s <= backoff_max_s, got {backoff_initial_s}, "
                f"{backoff_max_s}"
            )
        self.codec = codec
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._prefix = f"{key_prefix}:{codec.namespace.digest().hex()}:".encode()
        self._link: ClusterLink | RedisNode
        if is_cluster_url(url):
            self._link = ClusterLink(
                url,
                self.stats,
                socket_timeout_s=socket_timeout_s,
                backoff_initial_s=backoff_initial_s,
                backoff_max_s=backoff_max_s,
            )
            return
        client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            health_check_interval=0,
            retry=Retry(NoBackoff(), 0),  # the tier does its own backoff; fail fast here
        )
        self._link = RedisNode(
            client,
            _redact(url),
            self.stats,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
        )
        if not self._link.call(lambda c: c.ping(), None):
            logger.info("redis tier starts unhealthy; will retry %s", self._link.name)

    @property
    def healthy(self) -> bool:
        return self._link.healthy

    def redis_key(self, key: ChunkKey) -> bytes:
        return self._prefix + key.hex().encode()

    def _run(self, commands: Sequence[Command]) -> list[Any]:
        """One reply per command (``DOWN`` where its server is unreachable); error replies
        (OOM under maxmemory, CLUSTERDOWN, ...) come back as exception instances, counted
        as errors and logged, and the caller treats them as misses or failed puts."""
        replies = self._link.run(commands)
        refused = [r for r in replies if isinstance(r, redis.exceptions.ResponseError)]
        if refused:  # a server that answered: not a fault of the connection
            self.stats.add(errors=len(refused))
            logger.warning(
                "redis tier: %d of %d commands refused: %s", len(refused), len(replies), refused[0]
            )
        return replies

    # -- StorageTier --------------------------------------------------------------------------
    def get(self, key: ChunkKey) -> CompactedChunk | None:
        return self.get_many([key])[0]

    def put(self, key: ChunkKey, chunk: CompactedChunk) -> bool:
        return self.put_many([(key, chunk)])[0]

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def delete(self, key: ChunkKey) -> bool:
        return self._delete_keys([self.redis_key(key)]) > 0

    def _delete_keys(self, rkeys: Sequence[bytes]) -> int:
        replies = self._run([(k, [pack_command(b"DEL", k)]) for k in rkeys])
        return sum(r for r in replies if isinstance(r, int))

    def get_many(self, keys: Sequence[ChunkKey]) -> list[CompactedChunk | None]:
        if not keys:
            return []
        rkeys = [self.redis_key(k) for k in keys]
        raw = self._run([(k, [pack_command(b"GET", k)]) for k in rkeys])
        out: list[CompactedChunk | None] = []
        bad: list[bytes] = []
        hits = nbytes = 0
        for key, rkey, value in zip(keys, rkeys, raw, strict=True):
            chunk = None
            if isinstance(value, bytes):
                try:
                    chunk = self.codec.decode(value)
                except CorruptEntryError as exc:
                    logger.warning("redis tier refused %r: %s", key, exc)
                    bad.append(rkey)
            if chunk is None:
                out.append(None)
                continue
            hits += 1
            nbytes += len(value)
            out.append(chunk)
        self.stats.add(hits=hits, misses=len(keys) - hits, bytes_out=nbytes, rejected=len(bad))
        if bad:
            self._delete_keys(bad)
        return out

    def put_many(
        self, items: Sequence[tuple[ChunkKey, CompactedChunk | EncodedValue]]
    ) -> list[bool]:
        """Store chunks (encoded by this tier's codec) or values that codec encoded already
        (a quantizing store's, see :attr:`StorageTier.holds_encoded`), one round trip."""
        encoded = [
            (self.redis_key(k), c if isinstance(c, EncodedValue) else self.codec.encode(c))
            for k, c in items
        ]
        return self.put_encoded(encoded)

    def put_encoded(self, items: Sequence[tuple[bytes, EncodedValue | bytes]]) -> list[bool]:
        """Store encoded values under already-prefixed Redis keys, one round trip per server."""
        if not items:
            return []
        commands: list[Command] = []
        for rkey, value in items:
            parts = value.parts if isinstance(value, EncodedValue) else (value,)
            commands.append((rkey, pack_set(rkey, parts, self.ttl_ms)))
        results = self._run(commands)
        ok = [r == b"OK" or r is True for r in results]
        stored = sum(ok)
        self.stats.add(
            puts=stored,
            put_failures=len(items) - stored,
            bytes_in=sum(len(v) for (_, v), good in zip(items, ok, strict=True) if good),
        )
        return ok

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        rkeys = [self.redis_key(k) for k in keys]
        replies = self._run([(k, [pack_command(b"EXISTS", k)]) for k in rkeys])
        return [r == 1 for r in replies]

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        out["nodes_down"] = self._link.nodes_down()
        return out

    def close(self) -> None:
        self._link.close()


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
