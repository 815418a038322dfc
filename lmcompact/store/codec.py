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

(the payload of a quantized value is laid out as in :mod:`lmcompact.store.quant`).

Header fields: ``v`` value format version (:data:`VALUE_VERSION`), ``ns`` namespace digest
(16 bytes), ``dt`` dtype name, ``nt`` tokens in the chunk, ``L``/``H`` layers and kv heads,
``dk``/``dv`` head dims, ``n`` total kept rows, ``kc`` kept counts (int32 LE bytes, ``L*H``),
``plen`` payload bytes, ``ck`` checksum digest. The checksum covers the payload AND the header
fields above (in a canonical byte form), so a flipped kept count cannot pass either.

Quantized values (a codec made with ``quantize="int8"`` or ``"fp8"``, see
:mod:`lmcompact.store.quant`) carry version :data:`QUANTIZED_VALUE_VERSION` and one more
header field, ``q`` (the quantization), which the checksum covers too; their payload is
``positions (uint16) | key rows | value rows | key scales | value scales`` and ``dt`` stays
the chunk's own dtype, the one :meth:`ChunkCodec.decode` dequantizes into. Unquantized
values keep version :data:`VALUE_VERSION` and their bytes, so entries written before
quantization existed stay readable, and a build that reads only version 2 refuses a
quantized value as ``unsupported_version`` instead of misreading it. This build reads both;
a version-2 header with ``q`` or a version-4 header without it is refused (``bad_header``).
Which values a store may load is its namespace's business: the connector puts the
quantization into the namespace, so a quantized and an unquantized engine never share a key.

Zero copy: :meth:`ChunkCodec.encode` returns an :class:`EncodedValue`, the small frame head
followed by views of the chunk's own tensors (nothing is joined); the Redis tier writes
those buffers one after another into a single bulk string. :meth:`ChunkCodec.decode` checks
the bytes it is given in place and returns tensors that are views of them.

What each hash protects (the cryptographic ones only where a collision could be chosen):

* ``ck``, xxHash's xxh3-128 (non-cryptographic, tens of GB/s): accidental damage of a value,
  i.e. bit flips, truncation, a torn or mixed write, bytes of another chunk under this
  header. It does not defend against someone who can write to the store: whoever can write
  a value can write a matching digest of any unkeyed hash, so a cryptographic one here
  would cost time for no protection (the codec with blake2b checksums:
  ``docs/benchmarks/store-cpu.md``).
* chunk keys (:mod:`lmcompact.store.keys`), blake2b-256 prefix-chained over token ids: a
  collision there would serve one prompt's KV for another prompt, and prompts are chosen by
  users, who could search for collisions of a fast non-cryptographic hash; cryptographic.
* the namespace digest (:meth:`StoreNamespace.digest`), blake2b-128 of the engine's
  canonical config, computed once: a value of another model, dtype, layout or policy is
  never read as this engine's (cryptographic for the same reason as the keys: it feeds them).

A value is written with one Redis ``SET`` and decoded only after every check passed, so a
partial write, a damaged value or a value of an older format is refused
(:class:`CorruptEntryError`; the caller recomputes), never returned.
"""

from __future__ import annotations

import struct
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from lmcompact.store.chunk import (
    SUPPORTED_DTYPES,
    CompactedChunk,
    dtype_name,
    packed_nbytes,
    packed_span,
)
from lmcompact.store.keys import StoreNamespace
from lmcompact.store.quant import (
    FLOAT_DTYPES,
    QUANT_MODES,
    check_quantize,
    dequantize_payload,
    position_bytes,
    quantize_payload,
    quantized_nbytes,
)

MAGIC = b"LMCK"
MAX_HEADER_BYTES = 1 << 20
_PREFIX = struct.Struct("<4sI")
_ALIGN = 16

VALUE_VERSION = 2
"""Version of the value layout. 1 (crc32 / blake2b checksums) is refused; 2: xxh3-128.
Independent of the key derivation's :data:`lmcompact.store.keys.FORMAT_VERSION`: a value of
another version found under a valid key is refused, so the chunk is recomputed and
overwritten."""

QUANTIZED_VALUE_VERSION = 4
"""Version of quantized values (header field ``q``, payload of :mod:`lmcompact.store.quant`).
Unquantized values keep :data:`VALUE_VERSION`; this build reads both. 3 (one scale per row)
is refused as ``unsupported_version``: its scales would be misread as groups."""

CHECKSUM_BYTES = 16
_COUNTS_CACHE = 256  # distinct kept-count layouts remembered by a codec

# Decoded tensors are views of the (immutable) value bytes; torch warns once about that.
warnings.filterwarnings(
    "ignore",
    message="The given buffer is not writable",
    category=UserWarning,
    module=r"(.*[\\/])?lmcompact[\\/.]store[\\/.]codec",
)


Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class EncodedValue:
    """One encoded value as consecutive buffers, never joined by the codec.

    Attributes:
        parts: the frame head (magic, header length, header, padding) as bytes, then the
            payload ``positions | keys | values`` as memoryviews of the chunk's tensors:
            one view when the chunk lies packed in one buffer, else one per section (of a
            host copy when the chunk lives on a device). A quantized value's payload is
            one view of its own buffer.
        nbytes: total length, ``sum(len(p) for p in parts)``.
        quantize: the payload's quantization (``"int8"``, ``"fp8"``), None when raw.

    The views of a raw value alias the chunk: the chunk must not change until the value
    was written. A quantized value owns its payload.
    """

    parts: tuple[Buffer, ...]
    nbytes: int
    quantize: str | None = None

    def __len__(self) -> int:
        return self.nbytes

    def tobytes(self) -> bytes:
        """The value as one ``bytes`` object (one copy; for tests and tools)."""
        return b"".join(self.parts)


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


def _checksum(meta: bytes, parts: Sequence[Buffer]) -> bytes:
    h = xxhash.xxh3_128(meta)
    for p in parts:
        h.update(p)
    return h.digest()


_META = struct.Struct("<Q16s16s7Q")


_QMETA = struct.Struct("<16s")


def _meta(h: dict[str, Any]) -> bytes:
    """Canonical bytes of the header fields the checksum covers (all validated before);
    a quantized value's ``q`` follows the kept counts (whose length ``L``/``H`` fix)."""
    fields = (h["nt"], h["L"], h["H"], h["dk"], h["dv"], h["n"], h["plen"])
    meta = _META.pack(h["v"], h["ns"], h["dt"].encode(), *fields) + h["kc"]
    if "q" in h:
        meta += _QMETA.pack(h["q"].encode())
    return meta


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` without a copy when it is a contiguous CPU tensor (else one copy)."""
    if not t.is_cpu:
        t = t.detach().cpu()
    elif t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(torch.uint8).numpy().data


class ChunkCodec:
    """Encodes and decodes chunks of one namespace, counting what it refuses.

    Args:
        namespace: this engine's namespace; values of any other are refused.
        quantize: ``"int8"`` or ``"fp8"`` to encode quantized values
            (:mod:`lmcompact.store.quant`); None (default) encodes the chunk's own bytes.
            Decoding reads either kind whatever this is (values say what they are).
    """

    def __init__(self, namespace: StoreNamespace, quantize: str | None = None) -> None:
        self.namespace = namespace
        self.quantize = check_quantize(quantize)
        self._ns = namespace.digest()
        self._lock = threading.Lock()
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._unquantized = 0
        self._counts: dict[tuple[bytes, int, int, int, int], torch.Tensor] = {}

    @property
    def unquantized(self) -> int:
        """Chunks this quantizing codec encoded unquantized (not a float dtype, or a value
        float16 scales cannot carry; see :func:`lmcompact.store.quant.quantize_payload`)."""
        with self._lock:
            return self._unquantized

    def encode(self, chunk: CompactedChunk) -> EncodedValue:
        """Frame ``chunk`` (any device) as one self-checking value: quantized when this
        codec quantizes (a new buffer), else without copying its payload (a device chunk
        is copied to the host once)."""
        return self._encode(chunk)[0]

    def encode_served(self, chunk: CompactedChunk) -> tuple[EncodedValue, CompactedChunk]:
        """``chunk``'s value and the chunk a reader of that value gets back: ``chunk``
        itself for a raw value, the dequantized rows (on ``chunk``'s device, in its dtype)
        for a quantized one, so every tier of a quantizing store can serve the same rows
        from one quantization."""
        return self._encode(chunk, served=True)

    def _encode(
        self, chunk: CompactedChunk, served: bool = False
    ) -> tuple[EncodedValue, CompactedChunk]:
        mode = self.quantize
        payload = None if mode is None else quantize_payload(chunk, mode)
        if mode is None or payload is None:
            if mode is not None:
                with self._lock:
                    self._unquantized += 1
            span = packed_span(chunk) if chunk.device.type == "cpu" else None
            if span is not None:  # packed in one buffer (as the memory tiers hold chunks)
                parts: tuple[memoryview, ...] = (_byte_view(span),)
            else:
                parts = tuple(_byte_view(t) for t in (chunk.positions, chunk.keys, chunk.values))
            return self._frame(chunk, parts, None), chunk
        value = self._frame(chunk, (_byte_view(payload),), mode)
        if not served:
            return value, chunk
        dk, dv = int(chunk.keys.shape[1]), int(chunk.values.shape[1])
        back = dequantize_payload(
            payload, chunk.kept_counts, chunk.num_tokens, dk, dv, mode, chunk.dtype
        )
        return value, back

    def _frame(
        self, chunk: CompactedChunk, parts: tuple[memoryview, ...], quantize: str | None
    ) -> EncodedValue:
        header: dict[str, Any] = {
            "v": VALUE_VERSION if quantize is None else QUANTIZED_VALUE_VERSION,
            "ns": self._ns,
            "dt": dtype_name(chunk.dtype),
            "nt": chunk.num_tokens,
            "L": chunk.num_layers,
            "H": chunk.num_kv_heads,
            "dk": int(chunk.keys.shape[1]),
            "dv": int(chunk.values.shape[1]),
            "n": chunk.total_kept,
            "kc": chunk.kept_counts.numpy().astype("<i4", copy=False).tobytes(),
            "plen": sum(p.nbytes for p in parts),
        }
        if quantize is not None:
            header["q"] = quantize
        header["ck"] = _checksum(_meta(header), parts)
        packed = msgpack.packb(header, use_bin_type=True)
        pad = -(_PREFIX.size + len(packed)) % _ALIGN
        head = _PREFIX.pack(MAGIC, len(packed)) + packed + bytes(pad)
        return EncodedValue((head, *parts), len(head) + header["plen"], quantize)

    def verify(self, data: Buffer) -> tuple[int, int] | None:
        """Every check of :meth:`decode` (frame, header, namespace, shapes, checksum), no
        decoding: a tier verifies many values on several threads (the checksum releases
        the GIL) and then decodes each with ``checked=True``.

        Returns:
            ``(offset, length)`` of a quantized value's payload in ``data`` (what a tier
            may stage for :meth:`decode`'s ``staged``), None for an unquantized value.

        Raises:
            CorruptEntryError: as :meth:`decode`, counted in :meth:`metrics`.
        """
        try:
            h, _, off = self._frame_checked(data, checksum=True)
        except CorruptEntryError as exc:
            self._count_refusal(exc)
            raise
        return None if h.get("q") is None else (off, int(h["plen"]))

    def decode(
        self,
        data: Buffer,
        device: torch.device | str | None = None,
        *,
        checked: bool = False,
        staged: torch.Tensor | None = None,
    ) -> CompactedChunk:
        """Check and decode one value; tensors are zero-copy views of ``data`` (of a
        quantized value: one fresh packed buffer of the dequantized rows, in ``dt``, on
        ``device`` when given: the quantized bytes cross to it and are dequantized there,
        half the bytes of the rows and no host pass over them).

        ``checked``: :meth:`verify` passed on these very bytes (immutable since), so the
        checksum is not computed again; every other check still runs. ``staged``: the
        payload of this quantized value (the span :meth:`verify` returned) already copied
        to the device, used in place of a copy of ``data``'s payload.

        Raises:
            CorruptEntryError: (a subclass naming the check) for anything untrustworthy;
                the refusal is counted in :meth:`metrics`.
        """
        try:
            return self._decode(data, device, checksum=not checked, staged=staged)
        except CorruptEntryError as exc:
            self._count_refusal(exc)
            raise

    def _count_refusal(self, exc: CorruptEntryError) -> None:
        with self._lock:
            self._rejected[exc.reason] = self._rejected.get(exc.reason, 0) + 1

    def metrics(self) -> dict[str, int]:
        """Refusals so far, by reason."""
        with self._lock:
            return dict(self._rejected)

    def _decode(
        self,
        data: Buffer,
        device: torch.device | str | None,
        checksum: bool,
        staged: torch.Tensor | None = None,
    ) -> CompactedChunk:
        h, counts, off = self._frame_checked(data, checksum)
        n, nt, quantize = h["n"], h["nt"], h.get("q")
        dtype = SUPPORTED_DTYPES[h["dt"]]
        pos = "<u4" if quantize is None or position_bytes(nt) == 4 else "<u2"
        # as uint32 a negative position reads >= 2**31, so one max checks both bounds
        if n and int(np.frombuffer(data, dtype=pos, count=n, offset=off).max()) >= nt:
            raise ShapeMismatchError(f"positions outside [0, {nt})")
        if staged is not None and (
            quantize is None or staged.dtype != torch.uint8 or staged.numel() != h["plen"]
        ):
            raise ValueError(
                f"a staged payload must be the {h['plen']} uint8 bytes of a quantized value, "
                f"got {staged.numel()} {staged.dtype}"
            )
        if quantize is not None:
            if staged is not None:
                payload = staged
            else:
                payload = (
                    torch.frombuffer(data, dtype=torch.uint8, count=h["plen"], offset=off)
                    if n
                    else torch.empty(0, dtype=torch.uint8)
                )
                if device is not None:
                    payload = payload.to(device)
            return dequantize_payload(payload, counts, nt, h["dk"], h["dv"], quantize, dtype)
        positions, keys, values = _views(data, off, n, h["dk"], h["dv"], dtype)
        return CompactedChunk._trusted(keys, values, counts, positions, nt)

    def _frame_checked(
        self, data: Buffer, checksum: bool
    ) -> tuple[dict[str, Any], torch.Tensor, int]:
        """The checked header, its kept counts and the payload's offset."""
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
        counts = self._kept_counts(h)
        dtype = SUPPORTED_DTYPES[h["dt"]]
        quantize = h.get("q")
        if quantize is None:
            expected = packed_nbytes(h["n"], h["dk"], h["dv"], dtype.itemsize)
        else:
            expected = quantized_nbytes(h["n"], h["dk"], h["dv"], h["nt"])
        if h["plen"] != expected:
            raise ShapeMismatchError(
                f"payload length {h['plen']} does not match shapes (n={h['n']}, dk={h['dk']}, "
                f"dv={h['dv']}, {h['dt']}{'' if quantize is None else ' as ' + quantize}: "
                f"{expected} bytes)"
            )
        off = _PREFIX.size + hlen + (-(_PREFIX.size + hlen) % _ALIGN)
        have = len(mv) - off
        if have < h["plen"]:
            raise TruncatedEntryError(f"payload has {have} of {h['plen']} bytes")
        if have > h["plen"]:
            raise ShapeMismatchError(f"{have - h['plen']} bytes trail the payload")
        if checksum and _checksum(_meta(h), [mv[off:]]) != h["ck"]:
            raise ChecksumMismatchError("payload or header checksum mismatch")
        return h, counts, off

    def _parse_header(self, raw: memoryview) -> dict[str, Any]:
        try:
            h = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
        except Exception as exc:  # msgpack raises several unrelated types
            raise BadHeaderError(f"header is not valid msgpack: {exc}") from None
        if not isinstance(h, dict):
            raise BadHeaderError(f"header must be a map, got {type(h).__name__}")
        version = h.get("v")
        if version not in (VALUE_VERSION, QUANTIZED_VALUE_VERSION):
            raise UnsupportedVersionError(
                f"value format version {version!r} is not supported (this build reads "
                f"{VALUE_VERSION} and {QUANTIZED_VALUE_VERSION}); the chunk is recomputed"
            )
        if version == QUANTIZED_VALUE_VERSION:
            _check_quantized_header(h)
        elif "q" in h:
            raise BadHeaderError(f"a version-{version} value has no quantization field 'q'")
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
        if len(h["ck"]) != CHECKSUM_BYTES:
            raise BadHeaderError(f"checksum has {len(h['ck'])} bytes, expected {CHECKSUM_BYTES}")
        if min(h["L"], h["H"], h["dk"], h["dv"], h["nt"]) < 1:
            raise ShapeMismatchError("layers, heads, head dims and num_tokens must be >= 1")
        if len(h["kc"]) != 4 * h["L"] * h["H"]:
            raise ShapeMismatchError(
                f"kept counts have {len(h['kc'])} bytes, expected {4 * h['L'] * h['H']}"
            )
        return h

    def _kept_counts(self, h: dict[str, Any]) -> torch.Tensor:
        """The header's kept counts, checked against ``n`` and ``nt``, as ``(L, H)`` int32.

        Chunks of one model and budget share their counts, so checked tensors are reused
        (chunks are immutable; a tier shares ``kept_counts`` between copies the same way).
        """
        key = (h["kc"], h["L"], h["H"], h["n"], h["nt"])
        counts = self._counts.get(key)
        if counts is not None:
            return counts
        # as uint32 a negative count reads >= 2**31, so the max checks both bounds
        raw = np.frombuffer(h["kc"], dtype="<u4")
        total = int(raw.sum(dtype=np.uint64))
        if total != h["n"] or int(raw.max()) > h["nt"]:
            raise ShapeMismatchError(
                f"kept counts (sum {total}) inconsistent with n={h['n']}, nt={h['nt']}"
            )
        counts = torch.frombuffer(bytearray(h["kc"]), dtype=torch.int32).view(h["L"], h["H"])
        if len(self._counts) >= _COUNTS_CACHE:
            self._counts.clear()
        self._counts[key] = counts
        return counts


def _check_quantized_header(h: dict[str, Any]) -> None:
    """A quantized value names a quantization this torch reads and a float dtype to
    dequantize into."""
    q = h.get("q")
    if not isinstance(q, str) or q not in QUANT_MODES:
        raise BadHeaderError(f"a quantized value needs 'q' in {list(QUANT_MODES)}, got {q!r}")
    try:
        check_quantize(q, "header field 'q'")
    except ValueError as exc:
        raise BadHeaderError(str(exc)) from None
    dt = h.get("dt")
    if not isinstance(dt, str) or SUPPORTED_DTYPES.get(dt) not in FLOAT_DTYPES:
        raise BadHeaderError(f"a quantized value's dtype must be a float type, got {dt!r}")


def _views(
    data: Buffer, off: int, n: int, dk: int, dv: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions (n,), keys (n, dk), values (n, dv))`` viewing ``data`` from ``off``
    (the packed layout of :func:`lmcompact.store.chunk.unpack_views`)."""
    if n == 0:
        return (
            torch.empty(0, dtype=torch.int32),
            torch.empty(0, dk, dtype=dtype),
            torch.empty(0, dv, dtype=dtype),
        )
    k_off = off + 4 * n
    v_off = k_off + dtype.itemsize * n * dk
    return (
        torch.frombuffer(data, dtype=torch.int32, count=n, offset=off),
        torch.frombuffer(data, dtype=dtype, count=n * dk, offset=k_off).view(n, dk),
        torch.frombuffer(data, dtype=dtype, count=n * dv, offset=v_off).view(n, dv),
    )
