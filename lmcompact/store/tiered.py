"""``TieredStore``: GPU -> CPU -> Redis, composed from a validated ``StoreConfig``.

Puts write through every tier (the Redis one on a background thread, see
:mod:`lmcompact.store.writer`); gets look tiers up in order and copy a hit into the tiers
above it. ``lookup_prefix`` counts how many leading chunks some tier holds.

Quantized stores (``StoreConfig.quantize``): the tiers that hold the codec's values hold them
quantized (:mod:`lmcompact.store.quant`), about half the bytes of bf16: Redis, and the CPU
tier, which is then an :class:`EncodedCPUTier` (a host store's bytes are what users budget).
The GPU tier keeps holding chunks in the engine dtype (it serves views on the device;
dequantizing on every get would cost that), but it holds the DEQUANTIZED rows: a put
quantizes once (:meth:`ChunkCodec.encode_served`), gives the value tiers the value and the
GPU tier what that value decodes to, so a chunk reads the same from every tier, and a hit
promoted upward is that same chunk again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.codec import ChunkCodec, EncodedValue
from lmcompact.store.eviction import EVICTION_POLICIES, make_eviction_policy
from lmcompact.store.keys import ChunkKey, StoreNamespace
from lmcompact.store.quant import check_quantize
from lmcompact.store.tiers.base import StorageTier
from lmcompact.store.tiers.cpu_tier import CPUTier
from lmcompact.store.tiers.encoded_cpu import EncodedCPUTier
from lmcompact.store.tiers.gpu_tier import GPUTier
from lmcompact.store.tiers.memory import MemoryTier
from lmcompact.store.tiers.redis_url import check_redis_url
from lmcompact.store.writer import AsyncWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConfig:
    """What a :class:`TieredStore` is made of. Validated at construction.

    Attributes:
        gpu_capacity_bytes: GPU tier size; None means no GPU tier.
        gpu_device: GPU tier device; None means ``"cuda"`` when available, else ``"cpu"``.
        cpu_capacity_bytes: CPU tier size; None means no CPU tier.
        cpu_pin_memory: page-locked CPU buffers; None means "when CUDA is available".
        eviction: eviction policy of the memory tiers (``"lru"``, ``"fifo"``, ``"mod:Class"``).
        redis_url: ``redis://`` / ``rediss://`` URL of one server, or
            ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://``) seed nodes
            of a Redis / Valkey cluster (chunks spread over its slots); None means no
            Redis tier.
        redis_key_prefix: prefix of Redis keys.
        redis_ttl_s: Redis entry lifetime; None keeps entries until Redis evicts them.
        redis_socket_timeout_s: Redis socket timeout.
        redis_backoff_initial_s: first reconnect delay after Redis went away.
        redis_backoff_max_s: reconnect delay cap.
        redis_async_writes: write to Redis on a background thread (else inline).
        redis_queue_size: bound of the background write queue, in chunks.
        redis_queue_timeout_s: longest a put blocks on a full queue before dropping the write.
        metrics_log_interval_s: log a metrics line at most this often; None disables.
        quantize: ``"int8"`` or ``"fp8"`` (float8 e4m3fn) stores rows quantized, one float16
            scale per row (:mod:`lmcompact.store.quant`): Redis values shrink to about half
            of bf16, and every tier serves the dequantized rows (lossy; see the module
            docstring). None (default) stores the engine dtype's bytes. The namespace must
            differ from unquantized stores' (the connector adds the quantization to it).
    """

    gpu_capacity_bytes: int | None = None
    gpu_device: str | None = None
    cpu_capacity_bytes: int | None = 4 << 30
    cpu_pin_memory: bool | None = None
    eviction: str = "lru"
    redis_url: str | None = None
    redis_key_prefix: str = "lmc"
    redis_ttl_s: float | None = None
    redis_socket_timeout_s: float = 2.0
    redis_backoff_initial_s: float = 0.5
    redis_backoff_max_s: float = 30.0
    redis_async_writes: bool = True
    redis_queue_size: int = 64
    redis_queue_timeout_s: float = 0.5
    metrics_log_interval_s: float | None = 60.0
    quantize: str | None = None

    def __post_init__(self) -> None:
        check_quantize(self.quantize, "StoreConfig.quantize")
        for name in ("gpu_capacity_bytes", "cpu_capacity_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        if self.eviction not in EVICTION_POLICIES and ":" not in self.eviction:
            raise ValueError(
                f"eviction must be one of {sorted(EVICTION_POLICIES)} or 'module:Class', "
                f"got {self.eviction!r}"
            )
        positive = (
            "redis_socket_timeout_s",
            "redis_backoff_initial_s",
            "redis_backoff_max_s",
            "redis_queue_size",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.redis_backoff_initial_s > self.redis_backoff_max_s:
            raise ValueError(
                f"redis_backoff_initial_s ({self.redis_backoff_initial_s}) must be <= "
                f"redis_backoff_max_s ({self.redis_backoff_max_s})"
            )
        if self.redis_queue_timeout_s < 0:
            raise ValueError(
                f"redis_queue_timeout_s must be >= 0, got {self.redis_queue_timeout_s}"
            )
        for name in ("redis_ttl_s", "metrics_log_interval_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        if (
            self.gpu_capacity_bytes is None
            and self.cpu_capacity_bytes is None
            and not self.redis_url
        ):
            raise ValueError("a store needs at least one tier: set gpu/cpu capacity or redis_url")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _values_or_chunks(
    items: Sequence[tuple[ChunkKey, CompactedChunk]],
    values: Sequence[EncodedValue | None],
    owned: Sequence[CompactedChunk | None],
    copy: bool,
) -> list[tuple[ChunkKey, Any]]:
    """What a tier holding values gets: the quantized value where there is one, else the
    chunk (a memory tier's copy, or with ``copy`` a fresh one, for a background write)."""
    out: list[tuple[ChunkKey, Any]] = []
    for (key, chunk), value, mine in zip(items, values, owned, strict=True):
        if value is not None:
            out.append((key, value))
        else:
            out.append((key, mine or (chunk.clone() if copy else chunk)))
    return out


class TieredStore:
    """The chunk store the connector talks to.

    Args:
        namespace: this engine's namespace (keys and values of others are never used).
        config: tiers and their settings.
        tiers: build from these tiers instead (fastest first); ``config`` then only sets
            write-behind and logging. A tier named ``"redis"`` gets the background writer.
    """

    def __init__(
        self,
        namespace: StoreNamespace,
        config: StoreConfig | None = None,
        *,
        tiers: Sequence[StorageTier] | None = None,
    ) -> None:
        self.config = config or StoreConfig()
        self.namespace = namespace
        self.codec = ChunkCodec(namespace, quantize=self.config.quantize)
        self.tiers: list[StorageTier] = list(tiers) if tiers is not None else self._build()
        if not self.tiers:
            raise ValueError("a store needs at least one tier")
        if self.config.quantize is not None and not any(t.holds_encoded for t in self.tiers):
            logger.info(
                "store quantize=%s without a CPU or Redis tier: the GPU tier holds "
                "dequantized rows in the engine dtype (lossy, same bytes)",
                self.config.quantize,
            )
        self._writers: dict[int, AsyncWriter] = {}
        if self.config.redis_async_writes:
            for i, tier in enumerate(self.tiers):
                if tier.name == "redis":
                    self._writers[i] = AsyncWriter(
                        tier, self.config.redis_queue_size, self.config.redis_queue_timeout_s
                    )
        self._log_lock = threading.Lock()
        self._next_log = time.monotonic() + (self.config.metrics_log_interval_s or 0)

    def _build(self) -> list[StorageTier]:
        cfg = self.config
        out: list[StorageTier] = []
        if cfg.gpu_capacity_bytes is not None:
            out.append(
                GPUTier(
                    cfg.gpu_capacity_bytes,
                    cfg.gpu_device,
                    eviction=make_eviction_policy(cfg.eviction),
                )
            )
        if cfg.cpu_capacity_bytes is not None and cfg.quantize is not None:
            out.append(EncodedCPUTier(cfg.cpu_capacity_bytes, self.codec))
        elif cfg.cpu_capacity_bytes is not None:
            out.append(
                CPUTier(
                    cfg.cpu_capacity_bytes,
                    pin_memory=cfg.cpu_pin_memory,
                    eviction=make_eviction_policy(cfg.eviction),
                )
            )
        if cfg.redis_url is not None:
            from lmcompact.store.tiers.redis_tier import RedisTier  # redis is an optional extra

            out.append(
                RedisTier(
                    cfg.redis_url,
                    self.codec,
                    key_prefix=cfg.redis_key_prefix,
                    ttl_s=cfg.redis_ttl_s,
                    socket_timeout_s=cfg.redis_socket_timeout_s,
                    backoff_initial_s=cfg.redis_backoff_initial_s,
                    backoff_max_s=cfg.redis_backoff_max_s,
                )
            )
        return out

    def tier(self, name: str) -> StorageTier:
        """The tier called ``name`` (``"gpu"``, ``"cpu"``, ``"redis"``)."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier {name!r}; tiers: {[t.name for t in self.tiers]}")

    # -- writes -----------------------------------------------------------------------------
    def put(self, key: ChunkKey, chunk: CompactedChunk) -> bool:
        """Write ``chunk`` through every tier; True when at least one tier took it (or queued)."""
        return self.put_many([(key, chunk)])[0]

    def put_many(self, items: Sequence[tuple[ChunkKey, CompactedChunk]]) -> list[bool]:
        """Write ``items`` through every tier. The store copies: callers may reuse their
        tensors once this returns (background writes use the store's own copy).

        A quantizing store quantizes each chunk once: tiers that hold values get the
        quantized value (it owns its bytes), memory tiers the rows it decodes to."""
        values: list[EncodedValue | None] = [None] * len(items)
        if self.config.quantize is not None:
            served = []
            for j, (key, chunk) in enumerate(items):
                value, back = self.codec.encode_served(chunk)
                if value.quantize is not None:
                    values[j] = value
                served.append((key, back))
            items = served
        ok = [False] * len(items)
        owned: list[CompactedChunk | None] = [None] * len(items)
        for i, tier in enumerate(self.tiers):
            writer = self._writers.get(i)
            if writer is None:
                if tier.holds_encoded:
                    results = tier.put_many(_values_or_chunks(items, values, owned, copy=False))
                else:
                    results = tier.put_many(items)
                if isinstance(tier, MemoryTier):
                    for j, (key, _) in enumerate(items):
                        if results[j] and owned[j] is None:
                            owned[j] = tier.peek(key)
            else:
                results = [
                    writer.submit(key, item)
                    for key, item in _values_or_chunks(items, values, owned, copy=True)
                ]
            ok = [a or b for a, b in zip(ok, results, strict=True)]
        self._maybe_log()
        return ok

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for background writes; False on timeout."""
        return all(w.flush(timeout_s) for w in self._writers.values())

    # -- reads ------------------------------------------------------------------------------
    def get(self, key: ChunkKey) -> CompactedChunk | None:
        return self.get_many([key])[0]

    def get_many(
        self, keys: Sequence[ChunkKey], device: torch.device | str | None = None
    ) -> list[CompactedChunk | None]:
        """Chunks for ``keys`` (None where no tier has one); hits are promoted upward.
        ``device``: where the reader wants them; a quantized host tier
        (:class:`EncodedCPUTier`) dequantizes there, other tiers answer as they hold."""
        out: list[CompactedChunk | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not todo:
                break
            wanted = [keys[i] for i in todo]
            found = (
                tier.get_many(wanted, device)
                if isinstance(tier, EncodedCPUTier)
                else tier.get_many(wanted)
            )
            promote: list[tuple[ChunkKey, CompactedChunk]] = []
            still: list[int] = []
            for i, chunk in zip(todo, found, strict=True):
                if chunk is None:
                    still.append(i)
                else:
                    out[i] = chunk
                    promote.append((keys[i], chunk))
            if promote:
                for upper in self.tiers[:level]:
                    upper.put_many(promote)
            todo = still
        self._maybe_log()
        return out

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` are stored (in any tier), stopping at the first gap."""
        present = [False] * len(keys)
        for tier in self.tiers:
            gap = next((i for i, p in enumerate(present) if not p), len(keys))
            if gap == len(keys):
                break
            todo = [i for i in range(gap, len(keys)) if not present[i]]
            for i, hit in zip(todo, tier.contains_many([keys[i] for i in todo]), strict=True):
                present[i] = hit
        return next((i for i, p in enumerate(present) if not p), len(keys))

    def discard(self, key: ChunkKey) -> int:
        """Remove ``key`` from every tier (an entry found unusable); returns tiers that held it."""
        removed = 0
        for tier in self.tiers:
            try:
                removed += bool(tier.delete(key))
            except Exception:  # a tier that is down holds nothing we could serve anyway
                logger.warning("could not delete a chunk from tier %s", tier.name, exc_info=True)
        return removed

    def pin(self, keys: Sequence[ChunkKey]) -> list[tuple[int, ChunkKey]]:
        """Pin ``keys`` in every memory tier holding them, so loading them is safe.

        Returns:
            A token for :meth:`unpin` naming what was pinned.
        """
        pinned: list[tuple[int, ChunkKey]] = []
        for level, tier in enumerate(self.tiers):
            pinned += [(level, k) for k in keys if tier.pin(k)]
        return pinned

    def unpin(self, pinned: Sequence[tuple[int, ChunkKey]]) -> None:
        """Undo one :meth:`pin`. Unpinning twice raises RuntimeError (never clamped)."""
        for level, key in pinned:
            self.tiers[level].unpin(key)

    # -- observability ------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Counters per tier, codec refusals and background-writer state."""
        out: dict[str, Any] = {t.name: t.metrics() for t in self.tiers}
        out["codec_rejected"] = self.codec.metrics()
        if self.config.quantize is not None:
            out["codec_unquantized"] = self.codec.unquantized
        out["writers"] = {self.tiers[i].name: w.metrics() for i, w in self._writers.items()}
        return out

    def _maybe_log(self) -> None:
        interval = self.config.metrics_log_interval_s
        if interval is None or time.monotonic() < self._next_log:
            return
        with self._log_lock:
            if time.monotonic() < self._next_log:
                return
            self._next_log = time.monotonic() + interval
        parts = []
        for t in self.tiers:
            s = t.stats.snapshot()
            parts.append(
                f"{t.name}: hits={s['hits']} misses={s['misses']} in={s['bytes_in']} "
                f"out={s['bytes_out']} evictions={s['evictions']} rejected={s['rejected']}"
            )
        logger.info("store metrics | %s", " | ".join(parts))

    def close(self) -> None:
        """Finish background writes and release the tiers."""
        for w in self._writers.values():
            w.close()
        for t in self.tiers:
            t.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
