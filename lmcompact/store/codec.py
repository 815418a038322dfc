"""Wire format of one stored chunk: magic, msgpack header, raw tensor payload. No pickle.

::

    offset 0        b"LMCK"                          4 bytes
    offset 4        header length n (uint32 LE)      4 bytes
    offset 8        msgpack map (the header)          n bytes
                    zero padding to a 16-byte boundary
    payload_off     positions int32 (total_kept,)
                    keys   (total_kept, k_dim)  raw bytes of the dtype
                    values (total_kept, v_dim)
    end             payload_off + header["plen"]

Header fields: ``v`` format version, ``ns`` namespace digest (16 bytes), ``dt`` dtype name,
``nt`` tokens in the chunk, ``L``/``H`` layers and kv heads, ``dk``/``dv`` head dims, ``n``
total kept rows, ``kc`` kept counts (int32 LE bytes, ``L*H``), ``plen`` payload bytes,
``ca``/``ck`` checksum algorithm and digest. The checksum covers the payload AND the header
fields above (in a canonical byte form), so a flipped kept count cannot pass either.

A value is written with one Redis ``SET`` and decoded only after every check passed, so a
partial write or a damaged value is refused (:class:`CorruptEntryError`), never returned.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import warnings
import zlib
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from lmcompact.store.chunk import (
    SUPPORTED_DTYPES,
    CompactedChunk,
    dtype_name,
    packed_nbytes,
    unpack_views,
)
from lmcompact.store.keys import FORMAT_VERSION, StoreNamespace

MAGIC = b"LMCK"
MAX_HEADER_BYTES = 1 << 20
_PREFIX = struct.Struct("<4sI")
_ALIGN = 16

CHECKSUMS = ("crc32", "blake2b")
"""crc32 (zlib, ~4x faster here) guards against accidental damage; blake2b is cryptographic."""

# Decoded tensors are views of the (immutable) value bytes; torch warns once about that.
warnings.filterwarnings(
    "ignore",
    message="The given buffer is not writable",
    category=UserWarning,
    module=r"(.*[\\/])?lmcompact[\\/.]store[\\/.]codec",
)


class CorruptEntryError(ValueError):
    """A stored value that cannot be trusted; ``reason`` names the failed check."""

    reason = "corrupt"


class BadMagicError(CorruptEntryError):
    reason = "bad_magic"


class HeaderTooLargeError(CorruptEntryError):
    reason = "header_too_large"


class BadHeaderError(CorruptEntryError):
    reason = "bad_header"


class UnsupportedVersionError(CorruptEntryError):
    reason = "unsupported_version"


class ForeignNamespaceError(CorruptEntryError):
    reason = "foreign_namespace"


class TruncatedEntryError(CorruptEntryError):
    reason = "truncated"


class ShapeMismatchError(CorruptEntryError):
    reason = "shape_mismatch"


class ChecksumMismatchError(CorruptEntryError):
    reason = "checksum_mismatch"


REJECT_REASONS = tuple(
    cls.reason
    for cls in (
        BadMagicError,
        HeaderTooLargeError,
        BadHeaderError,
        UnsupportedVersionError,
        ForeignNamespaceError,
        TruncatedEntryError,
        ShapeMismatchError,
        ChecksumMismatchError,
    )
)


def _checksum(alg: str, meta: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
    if alg == "crc32":
        crc = zlib.crc32(meta)
        for p in parts:
            crc = zlib.crc32(p, crc)
        return crc.to_bytes(4, "little")
    h = hashlib.blake2b(meta, digest_size=16)
    for p in parts:
        h.update(p)
    return h.digest()


def _meta(h: dict[str, Any]) -> bytes:
    fields = (h["v"], h["ns"].hex(), h["dt"], h["nt"], h["L"], h["H"], h["dk"], h["dv"], h["n"])
    return "|".join(map(str, (*fields, h["plen"]))).encode() + h["kc"]


def _byte_view(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().data


class ChunkCodec:
    """Encodes and decodes chunks of one namespace, counting what it refuses.

    Args:
        namespace: this engine's namespace; values of any other are refused.
        checksum: ``"crc32"`` or ``"blake2b"`` for encoding (decoding accepts both).
    """

    def __init__(self, namespace: StoreNamespace, checksum: str = "crc32") -> None:
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {CHECKSUMS}, got {checksum!r}")
        self.namespace = namespace
        self.checksum = checksum
        self._ns = namespace.digest()
        self._lock = threading.Lock()
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)

    def encode(self, chunk: CompactedChunk) -> bytes:
        """Serialise ``chunk`` (any device) into one self-checking value."""
        parts = [_byte_view(chunk.positions), _byte_view(chunk.keys), _byte_view(chunk.values)]
        header: dict[str, Any] = {
            "v": FORMAT_VERSION,
            "ns": self._ns,
            "dt": dtype_name(chunk.dtype),
            "nt": chunk.num_tokens,
            "L": chunk.num_layers,
            "H": chunk.num_kv_heads,
            "dk": int(chunk.keys.shape[1]),
            "dv": int(chunk.values.shape[1]),
            "n": chunk.total_kept,
            "kc": chunk.kept_counts.contiguous().numpy().astype("<i4").tobytes(),
            "plen": sum(p.nbytes for p in parts),
            "ca": self.checksum,
        }
        header["ck"] = _checksum(self.checksum, _meta(header), parts)
        packed = msgpack.packb(header, use_bin_type=True)
        pad = -(_PREFIX.size + len(packed)) % _ALIGN
        return b"".join([_PREFIX.pack(MAGIC, len(packed)), packed, bytes(pad), *parts])

    def decode(self, data: bytes | bytearray | memoryview) -> CompactedChunk:
        """Check and decode one value; tensors are zero-copy views of ``data``.

        Raises:
            CorruptEntryError: (a subclass naming the check) for anything untrustworthy;
                the refusal is counted in :meth:`metrics`.
        """
        try:
            return self._decode(data)
        except CorruptEntryError as exc:
            with self._lock:
                self._rejected[exc.reason] = self._rejected.get(exc.reason, 0) + 1
            raise

    def metrics(self) -> dict[str, int]:
        """Refusals so far, by reason."""
        with self._lock:
            return dict(self._rejected)

    def _decode(self, data: bytes | bytearray | memoryview) -> CompactedChunk:
        mv = memoryview(data).cast("B")
        if len(mv) < _PREFIX.size:
            raise TruncatedEntryError(f"value of {len(mv)} bytes is shorter than its prefix")
        magic, hlen = _PREFIX.unpack_from(mv)
        if magic != MAGIC:
            raise BadMagicError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if hlen > MAX_HEADER_BYTES:
            raise HeaderTooLargeError(f"header of {hlen} bytes exceeds {MAX_HEADER_BYTES}")
        if len(mv) < _PREFIX.size + hlen:
            raise TruncatedEntryError(f"value of {len(mv)} bytes ends inside its header")
        h = self._parse_header(mv[_PREFIX.size : _PREFIX.size + hlen])
        dtype = SUPPORTED_DTYPES[h["dt"]]
        elt = dtype.itemsize
        expected = packed_nbytes(h["n"], h["dk"], h["dv"], elt)
        if h["plen"] != expected:
            raise ShapeMismatchError(
                f"payload length {h['plen']} does not match shapes (n={h['n']}, dk={h['dk']}, "
                f"dv={h['dv']}, {h['dt']}: {expected} bytes)"
            )
        off = _PREFIX.size + hlen + (-(_PREFIX.size + hlen) % _ALIGN)
        have = len(mv) - off
        if have < h["plen"]:
            raise TruncatedEntryError(f"payload has {have} of {h['plen']} bytes")
        if have > h["plen"]:
            raise ShapeMismatchError(f"{have - h['plen']} bytes trail the payload")
        payload = mv[off:]
        if _checksum(h["ca"], _meta(h), [payload]) != h["ck"]:
            raise ChecksumMismatchError("payload or header checksum mismatch")
        if h["plen"]:
            buf = torch.frombuffer(data, dtype=torch.uint8, count=h["plen"], offset=off)
        else:
            buf = torch.empty(0, dtype=torch.uint8)
        positions, keys, values = unpack_views(buf, h["n"], h["dk"], h["dv"], dtype)
        if h["n"] and (int(positions.min()) < 0 or int(positions.max()) >= h["nt"]):
            raise ShapeMismatchError(f"positions outside [0, {h['nt']})")
        counts = torch.frombuffer(bytearray(h["kc"]), dtype=torch.int32).view(h["L"], h["H"])
        return CompactedChunk(keys, values, counts, positions, h["nt"])

    def _parse_header(self, raw: memoryview) -> dict[str, Any]:
        try:
            h = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
        except Exception as exc:  # msgpack raises several unrelated types
            raise BadHeaderError(f"header is not valid msgpack: {exc}") from None
        if not isinstance(h, dict):
            raise BadHeaderError(f"header must be a map, got {type(h).__name__}")
        if h.get("v") != FORMAT_VERSION:
            raise UnsupportedVersionError(
                f"format version {h.get('v')!r} is not supported (this build reads "
                f"{FORMAT_VERSION})"
            )
        ints = ("nt", "L", "H", "dk", "dv", "n", "plen")
        for name in ints:
            if type(h.get(name)) is not int or h[name] < 0:
                raise BadHeaderError(f"header field {name!r} must be an int >= 0: {h.get(name)!r}")
        for name in ("ns", "kc", "ck"):
            if not isinstance(h.get(name), bytes):
                raise BadHeaderError(f"header field {name!r} must be bytes")
        if h["ns"] != self._ns:
            raise ForeignNamespaceError(
                f"value belongs to namespace {h['ns'].hex()}, this engine is {self._ns.hex()}"
            )
        if h.get("dt") not in SUPPORTED_DTYPES:
            raise BadHeaderError(f"dtype {h.get('dt')!r} not in {sorted(SUPPORTED_DTYPES)}")
        if h.get("ca") not in CHECKSUMS:
            raise BadHeaderError(f"checksum {h.get('ca')!r} not in {CHECKSUMS}")
        if min(h["L"], h["H"], h["dk"], h["dv"], h["nt"]) < 1:
            raise ShapeMismatchError("layers, heads, head dims and num_tokens must be >= 1")
        if len(h["kc"]) != 4 * h["L"] * h["H"]:
            raise ShapeMismatchError(
                f"kept counts have {len(h['kc'])} bytes, expected {4 * h['L'] * h['H']}"
            )
        counts = np.frombuffer(h["kc"], dtype="<i4").astype(np.int64)
        if int(counts.sum()) != h["n"] or counts.min() < 0 or counts.max() > h["nt"]:
            raise ShapeMismatchError(
                f"kept counts (sum {int(counts.sum())}) inconsistent with n={h['n']}, nt={h['nt']}"
            )
        return h
