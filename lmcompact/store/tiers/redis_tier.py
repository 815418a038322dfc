"""Redis tier: one key per chunk, value = the codec's bytes, written with a single SET.

A batch of chunks is written and read in one round trip each (pipelined ``SET`` / ``GET``).
Values are written from the codec's buffers (frame head plus views of the chunk's tensors,
see :mod:`lmcompact.store.tiers.resp`) and decoded in place over the bytes redis-py
received, so the payload is copied by neither side.

A SET is atomic, so a reader sees a whole value or none; anything else that can go wrong
with a value (damage, another engine's namespace, an old format) is caught by the codec,
counted as ``rejected`` and the key deleted. When Redis is unreachable (at start or
mid-run) the tier turns unhealthy: operations answer misses without touching the network,
one warning is logged, and a PING is retried with exponential backoff until it answers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.codec import ChunkCodec, CorruptEntryError, EncodedValue
from lmcompact.store.keys import ChunkKey
from lmcompact.store.tiers.base import StorageTier
from lmcompact.store.tiers.resp import execute_packed, pack_set

logger = logging.getLogger(__name__)

T = TypeVar("T")
_FAULTS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisTier(StorageTier):
    """Chunks in Redis, encoded by a :class:`ChunkCodec`.

    Args:
        url: ``redis://[:password@]host:port/db`` or ``rediss://`` (TLS).
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
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss"):
            raise ValueError(f"redis url must start with redis:// or rediss://, got {url!r}")
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
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            health_check_interval=0,
            retry=Retry(NoBackoff(), 0),  # the tier does its own backoff; fail fast here
        )
        self._safe_url = _redact(url)
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._backoff = backoff_initial_s
        self._healthy = True
        self._retry_at = 0.0
        self._state_lock = threading.Lock()
        if not self._call(lambda c: c.ping(), None):
            logger.info("redis tier starts unhealthy; will retry %s", self._safe_url)

    @property
    def healthy(self) -> bool:
        return self._healthy

    def redis_key(self, key: ChunkKey) -> bytes:
        return self._prefix + key.hex().encode()

    # -- health -----------------------------------------------------------------------------
    def _fault(self, exc: BaseException) -> None:
        with self._state_lock:
            self.stats.add(errors=1)
            if self._healthy:
                logger.warning(
                    "redis tier %s unreachable (%s: %s); serving misses, retrying in %.2fs",
                    self._safe_url,
                    type(exc).__name__,
                    exc,
                    self._backoff,
                )
            else:
                self._backoff = min(self._backoff * 2, self._backoff_max)
            self._healthy = False
            self._retry_at = time.monotonic() + self._backoff

    def _available(self) -> bool:
        """Whether to talk to Redis now; when unhealthy, PING once the backoff has passed."""
        if self._healthy:
            return True
        with self._state_lock:
            if self._healthy:
                return True
            if time.monotonic() < self._retry_at:
                return False
            self._retry_at = time.monotonic() + self._backoff  # one prober at a time
        try:
            self._client.connection_pool.disconnect()
            self._client.ping()
        except _FAULTS as exc:
            self._fault(exc)
            return False
        with self._state_lock:
            self._healthy = True
            self._backoff = self._backoff_initial
        logger.info("redis tier %s reachable again", self._safe_url)
        return True

    def _call(self, fn: Callable[[redis.Redis], T], default: T) -> T:
        if not self._available():
            return default
        try:
            return fn(self._client)
        except _FAULTS as exc:
            self._fault(exc)
            return default
        except redis.exceptions.RedisError as exc:  # e.g. OOM from maxmemory: not a fault
            self.stats.add(errors=1)
            logger.warning("redis tier error: %s", exc)
            return default

    # -- StorageTier --------------------------------------------------------------------------
    def get(self, key: ChunkKey) -> CompactedChunk | None:
        return self.get_many([key])[0]

    def put(self, key: ChunkKey, chunk: CompactedChunk) -> bool:
        return self.put_many([(key, chunk)])[0]

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def delete(self, key: ChunkKey) -> bool:
        return bool(self._call(lambda c: c.delete(self.redis_key(key)), 0))

    def get_many(self, keys: Sequence[ChunkKey]) -> list[CompactedChunk | None]:
        if not keys:
            return []

        def fetch(c: redis.Redis) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.get(self.redis_key(k))
            return pipe.execute()

        raw: list[Any] = self._call(fetch, [None] * len(keys))
        out: list[CompactedChunk | None] = []
        bad: list[ChunkKey] = []
        hits = nbytes = 0
        for key, value in zip(keys, raw, strict=True):
            chunk = None
            if value is not None:
                try:
                    chunk = self.codec.decode(value)
                except CorruptEntryError as exc:
                    logger.warning("redis tier refused %r: %s", key, exc)
                    bad.append(key)
            if chunk is None:
                out.append(None)
                continue
            hits += 1
            nbytes += len(value)
            out.append(chunk)
        self.stats.add(hits=hits, misses=len(keys) - hits, bytes_out=nbytes, rejected=len(bad))
        if bad:
            self._call(lambda c: c.delete(*[self.redis_key(k) for k in bad]), 0)
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
        """Store encoded values under already-prefixed Redis keys, in one round trip."""
        if not items:
            return []
        packed: list[Any] = []
        for rkey, value in items:
            parts = value.parts if isinstance(value, EncodedValue) else (value,)
            packed += pack_set(rkey, parts, self.ttl_ms)

        results = self._call(lambda c: execute_packed(c, packed, len(items)), [None] * len(items))
        failed = [r for r in results if isinstance(r, redis.exceptions.ResponseError)]
        if failed:  # e.g. OOM under maxmemory: not a connection fault
            self.stats.add(errors=len(failed))
            logger.warning(
                "redis tier: %d of %d SETs refused: %s", len(failed), len(items), failed[0]
            )
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

        def exists(c: redis.Redis) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.redis_key(k))
            return pipe.execute()

        return [bool(r) for r in self._call(exists, [0] * len(keys))]

    def close(self) -> None:
        with contextlib.suppress(*_FAULTS):
            self._client.close()


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
