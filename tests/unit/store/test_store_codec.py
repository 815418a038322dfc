from __future__ import annotations

import ctypes
import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcompact.store import ChunkCodec, CompactedChunk, CorruptEntryError
from lmcompact.store.chunk import SUPPORTED_DTYPES
from lmcompact.store.codec import (
    MAGIC,
    BadMagicError,
    ChecksumMismatchError,
    ForeignNamespaceError,
    HeaderTooLargeError,
    ShapeMismatchError,
    TruncatedEntryError,
    UnsupportedVersionError,
)
from tests.unit.store.store_helpers import make_chunk, make_namespace, same_chunk

DTYPES = sorted(SUPPORTED_DTYPES)
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def random_ragged(draw_counts, layers, heads, num_tokens, dk, dv, dtype, seed) -> CompactedChunk:
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(draw_counts, dtype=torch.int32).view(layers, heads)
    total = int(counts.sum())
    raw_k = torch.randint(0, 256, (total, dk), generator=g, dtype=torch.uint8)
    raw_v = torch.randint(0, 256, (total, dv), generator=g, dtype=torch.uint8)
    elt = torch.empty((), dtype=dtype).element_size()
    keys = torch.randint(0, 256, (total, dk * elt), generator=g, dtype=torch.uint8).view(dtype)
    values = torch.randint(0, 256, (total, dv * elt), generator=g, dtype=torch.uint8).view(dtype)
    del raw_k, raw_v
    positions = []
    for c in counts.flatten().tolist():
        positions.append(torch.randperm(num_tokens, generator=g)[:c].sort().values)
    pos = torch.cat(positions).to(torch.int32) if positions else torch.zeros(0, dtype=torch.int32)
    return CompactedChunk(keys, values, counts, pos, num_tokens)


@st.composite
def chunks(draw):
    layers = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 4))
    num_tokens = draw(st.integers(1, 24))
    counts = draw(
        st.lists(st.integers(0, num_tokens), min_size=layers * heads, max_size=layers * heads)
    )
    dk = draw(st.integers(1, 9))
    dv = draw(st.integers(1, 9))
    dtype = SUPPORTED_DTYPES[draw(st.sampled_from(DTYPES))]
    return random_ragged(counts, layers, heads, num_tokens, dk, dv, dtype, draw(st.integers(0, 99)))


@settings(max_examples=150, deadline=None)
@given(chunk=chunks())
def test_round_trip_ragged(chunk):
    codec = ChunkCodec(make_namespace())
    value = codec.encode(chunk)
    assert len(value) == sum(memoryview(p).nbytes for p in value.parts)
    back = codec.decode(value.tobytes())
    assert same_chunk(back, chunk)
    assert back.dtype == chunk.dtype and back.keys.shape == chunk.keys.shape
    for layer in range(chunk.num_layers):
        for head in range(chunk.num_kv_heads):
            k, _, p = back.head(layer, head)
            assert k.shape[0] == p.shape[0] == int(chunk.kept_counts[layer, head])


@settings(max_examples=60, deadline=None)
@given(chunk=chunks(), data=st.data())
def test_any_truncation_is_refused(chunk, data):
    codec = ChunkCodec(make_namespace())
    value = codec.encode(chunk).tobytes()
    cut = data.draw(st.integers(0, len(value) - 1))
    with pytest.raises(CorruptEntryError):
        codec.decode(value[:cut])


@settings(max_examples=80, deadline=None)
@given(chunk=chunks(), data=st.data())
def test_any_single_byte_flip_is_refused(chunk, data):
    codec = ChunkCodec(make_namespace())
    value = bytearray(codec.encode(chunk).tobytes())
    hlen = struct.unpack_from("<I", value, 4)[0]
    pad_end = 8 + hlen + (-(8 + hlen) % 16)
    # every byte but the alignment padding matters
    pos = data.draw(st.integers(0, len(value) - 1).filter(lambda i: not 8 + hlen <= i < pad_end))
    value[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(CorruptEntryError):
        codec.decode(bytes(value))


def rewrite_header(value: bytes, **changes) -> bytes:
    hlen = struct.unpack_from("<I", value, 4)[0]
    header = msgpack.unpackb(value[8 : 8 + hlen])
    header.update(changes)
    packed = msgpack.packb(header, use_bin_type=True)
    payload = value[8 + hlen + (-(8 + hlen) % 16) :]
    pad = bytes(-(8 + len(packed)) % 16)
    return MAGIC + struct.pack("<I", len(packed)) + packed + pad + payload


@pytest.mark.parametrize(
    ("damage", "error", "reason"),
    [
        (lambda v: b"XXXX" + v[4:], BadMagicError, "bad_magic"),
        (
            lambda v: v[:4] + struct.pack("<I", 1 << 30) + v[8:],
            HeaderTooLargeError,
            "header_too_large",
        ),
        (lambda v: rewrite_header(v, v=99), UnsupportedVersionError, "unsupported_version"),
        (lambda v: rewrite_header(v, ns=b"\0" * 16), ForeignNamespaceError, "foreign_namespace"),
        (lambda v: v[:-1], TruncatedEntryError, "truncated"),
        (lambda v: v + b"\0", ShapeMismatchError, "shape_mismatch"),
        (lambda v: rewrite_header(v, plen=8), ShapeMismatchError, "shape_mismatch"),
        (lambda v: rewrite_header(v, dk=8), ShapeMismatchError, "shape_mismatch"),
        (
            lambda v: v[:-3] + bytes([v[-3] ^ 0xFF]) + v[-2:],
            ChecksumMismatchError,
            "checksum_mismatch",
        ),
    ],
)
def test_each_refusal_has_its_class_and_counter(damage, error, reason):
    codec = ChunkCodec(make_namespace())
    value = codec.encode(make_chunk(1)).tobytes()
    with pytest.raises(error) as info:
        codec.decode(damage(value))
    assert isinstance(info.value, ValueError)
    assert codec.metrics()[reason] == 1
    assert sum(codec.metrics().values()) == 1


def test_kept_counts_shuffle_fails_checksum():
    codec = ChunkCodec(make_namespace())
    counts = torch.tensor([[3, 5]], dtype=torch.int32)
    chunk = random_ragged([3, 5], 1, 2, 8, 4, 4, torch.float16, 0)
    assert torch.equal(chunk.kept_counts, counts)
    forged = rewrite_header(codec.encode(chunk).tobytes(), kc=struct.pack("<2i", 5, 3))
    with pytest.raises(ChecksumMismatchError):
        codec.decode(forged)


def test_encode_is_zero_copy():
    """The payload parts of an encoded value are views of the chunk's own tensors."""
    codec = ChunkCodec(make_namespace())
    chunk = make_chunk(2, layers=3, heads=2, kept=64, dim=32)
    value = codec.encode(chunk)
    head, *payload = value.parts
    assert len(head) % 16 == 0 and len(head) < 512
    assert len(payload) == 3
    for part, tensor in zip(payload, (chunk.positions, chunk.keys, chunk.values), strict=True):
        view = torch.frombuffer(part, dtype=torch.uint8)
        assert view.data_ptr() == tensor.data_ptr() and view.numel() == tensor.nbytes
    assert value.nbytes == len(head) + chunk.payload_nbytes
    # the joined bytes decode back to the chunk
    assert same_chunk(codec.decode(value.tobytes()), chunk)
    # a chunk packed in one buffer (as the memory tiers hold them) is framed as one view
    packed = chunk.clone()
    head2, *payload2 = codec.encode(packed).parts
    assert head2 == head and len(payload2) == 1
    view = torch.frombuffer(payload2[0], dtype=torch.uint8)
    assert view.data_ptr() == packed.positions.data_ptr()
    assert view.numel() == packed.payload_nbytes
    assert codec.encode(packed).tobytes() == value.tobytes()


def test_decode_is_zero_copy():
    codec = ChunkCodec(make_namespace())
    value = codec.encode(make_chunk(2)).tobytes()
    back = codec.decode(value)
    # the decoded tensors point into the value's own bytes
    addr = ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value
    assert addr is not None
    for t in (back.positions, back.keys, back.values):
        assert addr <= t.data_ptr() < addr + len(value)


def test_dense_helpers_round_trip():
    k = torch.randn(2, 3, 4, 8)
    v = torch.randn(2, 3, 4, 6)
    chunk = CompactedChunk.from_dense(k, v, torch.tensor([0, 3, 5, 9]), num_tokens=10)
    assert chunk.uniform_count() == 4
    dk, dv, dp = chunk.to_dense()
    assert torch.equal(dk, k) and torch.equal(dv, v)
    assert dp.shape == (2, 3, 4) and dp[1, 2].tolist() == [0, 3, 5, 9]
    ragged = random_ragged([1, 2], 1, 2, 4, 2, 2, torch.float32, 0)
    assert ragged.uniform_count() is None
    with pytest.raises(ValueError, match="uniform"):
        ragged.to_dense()
    with pytest.raises(ValueError, match="positions are required"):
        CompactedChunk.from_dense(k, v, None, num_tokens=10)


def test_chunk_validation():
    k = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="kept_counts sum"):
        CompactedChunk(
            k, k, torch.tensor([[3]], dtype=torch.int32), torch.zeros(4, dtype=torch.int32), 4
        )
    with pytest.raises(ValueError, match="not supported"):
        CompactedChunk(
            k.double(),
            k.double(),
            torch.tensor([[4]], dtype=torch.int32),
            torch.zeros(4, dtype=torch.int32),
            4,
        )


# Values written by the previous value format (version 1, crc32 and blake2b checksums) for
# make_chunk(0, layers=1, heads=2, kept=2, dim=4) in make_namespace(): real bytes of that build.
V1_CRC32 = (
    "4c4d434b5f0000008da17601a26e73c410a4ed80bea5fafd29853b09b70f8be991a26474a7666c6f617433"
    "32a26e7404a14c01a14802a2646b04a2647604a16e04a26b63c4080200000002000000a4706c656ecc90a2"
    "6361a56372633332a2636bc404390b4c2700000000000000000000000000020000000000000002000000"
    "851b90bf8a8093bfd64b80be5d25debe1545593f8327313f6dcca1bec15f07c03801a53ef4b4a1bfff30b3"
    "3ebbc39d3e776ff53d936b9e3f8ef28e3f7c367dbec223adbf4614d9bf0410113f5d234b3f8b4d193f5b0d"
    "c7bfcac6aebe4e2fed3f6b0c403f2be315bfeb8e31bea4e13b3ec0d6b13f000dcb3f9c40723f33fb57bf"
)
V1_BLAKE2B = (
    "4c4d434b6d0000008da17601a26e73c410a4ed80bea5fafd29853b09b70f8be991a26474a7666c6f617433"
    "32a26e7404a14c01a14802a2646b04a2647604a16e04a26b63c4080200000002000000a4706c656ecc90a2"
    "6361a7626c616b653262a2636bc41028acd79d307fe3dd6ce7d746b40b2097000000000000000000000000"
    "000000020000000000000002000000851b90bf8a8093bfd64b80be5d25debe1545593f8327313f6dcca1be"
    "c15f07c03801a53ef4b4a1bfff30b33ebbc39d3e776ff53d936b9e3f8ef28e3f7c367dbec223adbf4614d9"
    "bf0410113f5d234b3f8b4d193f5b0dc7bfcac6aebe4e2fed3f6b0c403f2be315bfeb8e31bea4e13b3ec0d6"
    "b13f000dcb3f9c40723f33fb57bf"
)


@pytest.mark.parametrize("old", [V1_CRC32, V1_BLAKE2B], ids=["crc32", "blake2b"])
def test_previous_format_is_refused_not_misread(old):
    """A value of the previous format is refused as such (the caller recomputes the chunk),
    although its payload is intact and its namespace is this engine's."""
    codec = ChunkCodec(make_namespace())
    value = bytes.fromhex(old)
    header = msgpack.unpackb(value[8 : 8 + struct.unpack_from("<I", value, 4)[0]])
    assert header["v"] == 1 and header["ns"] == make_namespace().digest()
    with pytest.raises(UnsupportedVersionError, match="version 1"):
        codec.decode(value)
    assert codec.metrics()["unsupported_version"] == 1
    # the same chunk in the current format decodes
    chunk = make_chunk(0, layers=1, heads=2, kept=2, dim=4)
    assert same_chunk(codec.decode(codec.encode(chunk).tobytes()), chunk)


def test_checksum_covers_the_header_fields():
    """A header rewritten with a consistent but different shape fails the checksum."""
    codec = ChunkCodec(make_namespace())
    value = codec.encode(make_chunk(3, kept=8)).tobytes()
    forged = rewrite_header(value, nt=17)
    with pytest.raises(ChecksumMismatchError):
        codec.decode(forged)
