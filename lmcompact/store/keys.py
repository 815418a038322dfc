"""Chunk keys: a prefix-chained hash over token ids, folded with a store namespace.

For chunk size ``S`` and token ids ``t``, chunk ``i`` covers ``t[i*S:(i+1)*S]`` and its key is::

    root  = blake2b(b"lmcompact-chunk-root" | namespace.digest() | S)
    key_i = blake2b(key_{i-1} | int64-LE bytes of the chunk's token ids),   key_{-1} = root

so a key names the whole prefix up to the chunk's end, and two engines whose namespaces differ
(model, KV dtype, layout, tensor-parallel size, policy, format) never share a key.

Under tensor parallelism each rank holds a slice of the KV heads and stores it under its own
key. The chain above runs once, in the namespace with ``tp_rank`` 0 (the chunk's key, which
the scheduler names in its metadata); rank ``r`` of ``n > 1`` stores its slice under
:meth:`ChunkKey.for_rank`::

    slice_r = blake2b(key | int64-LE r | int64-LE n, person="lmc-tp-slice")

With one rank the slice key is the chunk key, so a single-GPU engine's keys do not change. Only
bytes go into the hash (never Python ``hash``), so keys are stable across processes and hosts.

The hash is cryptographic on purpose: two prompts with one key would get each other's KV,
and prompts are chosen by users, who could search for collisions of a fast
non-cryptographic hash. It costs little here (2 KiB of token ids per chunk). Integrity of
the stored bytes is the codec's xxh3-128 checksum (:mod:`lmcompact.store.codec`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1
"""Version of the key derivation (it enters every namespace, so every key); bump on any
incompatible change of it. The value layout has its own version,
:data:`lmcompact.store.codec.VALUE_VERSION`: values of another one are refused under
unchanged keys, and so rewritten."""

DEFAULT_CHUNK_SIZE = 256
KEY_BYTES = 32


@dataclass(frozen=True)
class StoreNamespace:
    """Everything that makes stored KV of one engine unusable by another.

    Attributes:
        model_id: model name or path (e.g. ``"HuggingFaceTB/SmolLM2-135M-Instruct"``).
        kv_dtype: dtype of the stored KV, e.g. ``"bfloat16"``.
        kv_layout: name of the KV layout the chunks were taken from (e.g. ``"vllm-cpu-0.32"``).
        tp_rank: tensor-parallel rank of this worker.
        tp_world_size: tensor-parallel world size.
        policy_name: compaction policy that produced the chunks (``"none"`` for full KV).
        policy_params: the policy's parameters; must be JSON-serialisable. They enter the
            namespace as canonical JSON (sorted keys, no spaces).
        format_version: store format version.
    """

    model_id: str
    kv_dtype: str
    kv_layout: str
    tp_rank: int = 0
    tp_world_size: int = 1
    policy_name: str = "none"
    policy_params: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    format_version: int = FORMAT_VERSION
    policy_params_json: str = field(init=False, default="")

    def __post_init__(self) -> None:
        for name in ("model_id", "kv_dtype", "kv_layout", "policy_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.tp_world_size < 1:
            raise ValueError(f"tp_world_size must be >= 1, got {self.tp_world_size}")
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_world_size}), got {self.tp_rank}")
        if self.format_version < 1:
            raise ValueError(f"format_version must be >= 1, got {self.format_version}")
        try:
            canonical = json.dumps(
                dict(self.policy_params), sort_keys=True, separators=(",", ":"), allow_nan=False
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"policy_params must be JSON-serialisable (str keys, finite numbers, lists, "
                f"dicts): {self.policy_params!r} ({exc})"
            ) from None
        object.__setattr__(self, "policy_params_json", canonical)

    def canonical(self) -> bytes:
        """Canonical JSON bytes of every field; the input of :meth:`digest`."""
        doc = {
            "format_version": self.format_version,
            "kv_dtype": self.kv_dtype,
            "kv_layout": self.kv_layout,
            "model_id": self.model_id,
            "policy": self.policy_name,
            "policy_params": json.loads(self.policy_params_json),
            "tp_rank": self.tp_rank,
            "tp_world_size": self.tp_world_size,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        """16-byte blake2b digest of :meth:`canonical`; written into every stored value."""
        return hashlib.blake2b(self.canonical(), digest_size=16, person=b"lmc-namespace").digest()


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Key of one stored chunk: 32 bytes naming the namespace and the whole token prefix."""

    digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != KEY_BYTES:
            raise ValueError(f"a chunk key has {KEY_BYTES} bytes, got {len(self.digest)}")

    def hex(self) -> str:
        return self.digest.hex()

    def for_rank(self, rank: int, world_size: int) -> ChunkKey:
        """Key of tensor-parallel rank ``rank``'s slice of this chunk (itself when
        ``world_size`` is 1)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got {rank} of {world_size}")
        if world_size == 1:
            return self
        h = hashlib.blake2b(self.digest, digest_size=KEY_BYTES, person=b"lmc-tp-slice")
        h.update(rank.to_bytes(8, "little") + world_size.to_bytes(8, "little"))
        return ChunkKey(h.digest())

    def slices(self, world_size: int) -> tuple[ChunkKey, ...]:
        """Keys of every rank's slice, in rank order."""
        return tuple(self.for_rank(rank, world_size) for rank in range(world_size))

    def __repr__(self) -> str:
        return f"ChunkKey({self.digest.hex()[:16]}..)"


TokenIds = Sequence[int] | np.ndarray | torch.Tensor


def _token_bytes(token_ids: TokenIds) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        arr = token_ids.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(token_ids)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype="<i8")


class ChunkKeyer:
    """Derives chunk keys for one namespace and chunk size.

    Args:
        namespace: the engine's store namespace.
        chunk_size: tokens per chunk (>= 1).
    """

    def __init__(self, namespace: StoreNamespace, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.namespace = namespace
        self.chunk_size = chunk_size
        self._root = hashlib.blake2b(
            b"lmcompact-chunk-root" + namespace.digest() + chunk_size.to_bytes(8, "little"),
            digest_size=KEY_BYTES,
        ).digest()

    def keys(self, token_ids: TokenIds, *, include_partial: bool = False) -> list[ChunkKey]:
        """Keys of the chunks of ``token_ids``, in order.

        Args:
            token_ids: ``(num_tokens,)`` integer token ids (list, numpy or torch).
            include_partial: also key a trailing chunk shorter than ``chunk_size``.

        Returns:
            One key per full chunk (plus the partial one when asked).
        """
        arr = _token_bytes(token_ids)
        size = self.chunk_size
        n_chunks = len(arr) // size
        if include_partial and len(arr) % size:
            n_chunks += 1
        out: list[ChunkKey] = []
        prev = self._root
        for i in range(n_chunks):
            h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
            h.update(arr[i * size : (i + 1) * size].tobytes())
            prev = h.digest()
            out.append(ChunkKey(prev))
        return out


def chunk_keys(
    token_ids: TokenIds,
    namespace: StoreNamespace,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    include_partial: bool = False,
) -> list[ChunkKey]:
    """Keys of the chunks of ``token_ids`` (see :class:`ChunkKeyer`)."""
    return ChunkKeyer(namespace, chunk_size).keys(token_ids, include_partial=include_partial)
