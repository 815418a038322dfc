"""Quantized stored chunks (int8 / fp8 rows, one float16 scale per 64 channels): the bounds of the
round trip, the wire format's checks, the byte ratio, and the tiered store's namespaces."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgpack
import numpy as np
import pytest
import torch

from lmcompact.store import (
    ChunkCodec,
    CompactedChunk,
    CorruptEntryError,
    CPUTier,
    StoreConfig,
    TieredStore,
    chunk_keys,
)
from lmcompact.store.chunk import packed_span
from lmcompact.store.codec import (
    QUANTIZED_VALUE_VERSION,
    VALUE_VERSION,
    BadHeaderError,
    ChecksumMismatchError,
    EncodedValue,
    ForeignNamespaceError,
    ShapeMismatchError,
    UnsupportedVersionError,
)
from lmcompact.store.keys import ChunkKey
from lmcompact.store.quant import QUANT_DTYPES, quantized_nbytes
from lmcompact.store.tiers.base import StorageTier
from tests.unit.store.store_helpers import make_chunk, make_namespace, same_chunk
from tests.unit.store.test_store_codec import random_ragged, rewrite_header

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

MODES = [m for m in ("int8", "fp8") if m in QUANT_DTYPES]
QMAX = {"int8": 127.0, "fp8": 448.0}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
NS_PLAIN = make_namespace(policy_params={"budget": 1.0})
NS_INT8 = make_namespace(policy_params={"budget": 1.0, "quantize": "int8"})


# ----------------------------------------------------------------------------- helpers
def round_trip(chunk: CompactedChunk, mode: str) -> tuple[bytes, CompactedChunk]:
    codec = ChunkCodec(NS_INT8, quantize=mode)
    value = codec.encode(chunk)
    assert value.quantize == mode
    raw = value.tobytes()
    back = codec.decode(raw)
    assert back.dtype == chunk.dtype and back.keys.shape == chunk.keys.shape
    assert back.values.shape == chunk.values.shape
    assert torch.equal(back.kept_counts, chunk.kept_counts)
    assert torch.equal(back.positions, chunk.positions) and back.num_tokens == chunk.num_tokens
    return raw, back


def groups_of(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``(n, d)`` as the format's scale groups, one a row: 64 channels each where
    64 divides ``d``, else the whole row (computed here on its own)."""
    d = rows.shape[1]
    return rows.reshape(-1, 64 if d % 64 == 0 else d)


def stored_scales(rows: torch.Tensor, qmax: float) -> np.ndarray:
    """The scale the format promises per group, computed here on its own: absmax / qmax in
    float64, rounded up to the nearest float16."""
    exact = groups_of(rows).double().abs().amax(dim=1).numpy() / qmax
    half = exact.astype(np.float16)
    up = np.nextafter(half, np.float16(np.inf))
    return np.where(half.astype(np.float64) < exact, up, half).astype(np.float64)


def assert_int8_bound(x: torch.Tensor, deq: torch.Tensor) -> None:
    """|x - deq| <= s / 2 per element, s = absmax / 127 (as float16, rounded up); plus the
    one rounding of the dequantized value to the chunk's dtype."""
    s = stored_scales(x, 127.0)[:, None]
    x, deq = groups_of(x), groups_of(deq)
    xd, dd = x.double().numpy(), deq.double().numpy()
    rounding = UNIT_ROUNDOFF[deq.dtype] * np.abs(dd) + 2.0**-22 * 127 * s  # fp32 arithmetic
    assert (np.abs(xd - dd) <= s / 2 + rounding).all()
    # and the stored step is absmax / 127 within float16's 2^-10 (where float16 is normal)
    exact = x.double().abs().amax(dim=1).numpy()[:, None] / 127
    normal = exact >= 2.0**-14
    assert (s[normal] <= exact[normal] * (1 + 2.0**-10)).all()


def assert_fp8_bound(x: torch.Tensor, deq: torch.Tensor) -> None:
    """e4m3 keeps 3 mantissa bits: |x - deq| <= 2^-4 |x| where x / s is normal
    (|x / s| >= 2^-6), else <= 2^-10 s (half the subnormal step); plus the dtype rounding."""
    s = stored_scales(x, 448.0)[:, None]
    x, deq = groups_of(x), groups_of(deq)
    xd, dd = x.double().numpy(), deq.double().numpy()
    err = np.abs(xd - dd)
    rounding = UNIT_ROUNDOFF[deq.dtype] * np.abs(dd) + 2.0**-22 * np.abs(xd)
    normal = np.abs(xd) >= 2.0**-6 * s
    assert (err[normal] <= 2.0**-4 * np.abs(xd[normal]) + rounding[normal]).all()
    sub = ~normal
    assert (err[sub] <= (2.0**-10 * np.broadcast_to(s, xd.shape))[sub] + rounding[sub]).all()


def assert_bound(chunk: CompactedChunk, back: CompactedChunk, mode: str) -> None:
    check = assert_int8_bound if mode == "int8" else assert_fp8_bound
    check(chunk.keys, back.keys)
    check(chunk.values, back.values)


class BytesTier(StorageTier):
    """Holds the codec's values as bytes, as the Redis tier does (no network): chunks are
    encoded by its codec, values a quantizing store hands it are kept as given."""

    name = "bytes"
    holds_encoded = True

    def __init__(self, codec: ChunkCodec) -> None:
        super().__init__()
        self.codec = codec
        self.values: dict[ChunkKey, bytes] = {}

    def put_many(self, items: Sequence[tuple[ChunkKey, CompactedChunk | EncodedValue]]):
        for key, item in items:
            value = item if isinstance(item, EncodedValue) else self.codec.encode(item)
            self.values[key] = value.tobytes()
        return [True] * len(items)

    def put(self, key: ChunkKey, chunk: CompactedChunk) -> bool:
        return self.put_many([(key, chunk)])[0]

    def get(self, key: ChunkKey) -> CompactedChunk | None:
        raw = self.values.get(key)
        if raw is None:
            return None
        try:
            return self.codec.decode(raw)
        except CorruptEntryError:
            self.stats.add(rejected=1)
            return None

    def contains(self, key: ChunkKey) -> bool:
        return key in self.values

    def delete(self, key: ChunkKey) -> bool:
        return self.values.pop(key, None) is not None


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_the_quantizer_bound(mode: str, dtype: torch.dtype) -> None:
    chunk = make_chunk(7, layers=3, heads=2, kept=16, dim=64, dtype=dtype)
    chunk.keys.mul_(10.0 ** torch.linspace(-5, 4, chunk.total_kept).to(dtype)[:, None])
    raw, back = round_trip(chunk, mode)
    assert_bound(chunk, back, mode)
    # the stored scales are exactly absmax / qmax rounded up to float16 (after the rows)
    n = chunk.total_kept
    scales = np.frombuffer(raw[len(raw) - 4 * n :], dtype="<f2").astype(np.float64)
    assert np.array_equal(scales[:n], stored_scales(chunk.keys, QMAX[mode]))
    assert np.array_equal(scales[n:], stored_scales(chunk.values, QMAX[mode]))
    # the quantization does lose something (the test is not vacuous)
    assert not torch.equal(back.keys, chunk.keys)


@pytest.mark.parametrize("mode", MODES)
def test_the_bound_is_tight_for_int8_and_met_by_fp8_on_every_row(mode: str) -> None:
    """A row's largest value comes back (nearly) exactly; int8's worst error reaches close
    to half a step over many rows (the bound is the quantizer's, not slack)."""
    chunk = make_chunk(1, layers=2, heads=4, kept=64, dim=128)
    _, back = round_trip(chunk, mode)
    assert_bound(chunk, back, mode)
    x = groups_of(chunk.keys).double()  # 128 channels: two groups a row
    amax = x.abs().amax(dim=1)
    at_max = x.abs().argmax(dim=1)
    rows = torch.arange(x.shape[0])
    got = groups_of(back.keys).double()[rows, at_max].abs()
    assert torch.allclose(got, amax, rtol=2.0**-10)
    if mode == "int8":
        worst = ((x - groups_of(back.keys).double()).abs() / (amax[:, None] / 127)).max()
        assert 0.45 < worst <= 0.5 * (1 + 2.0**-9)


def test_an_outlier_channel_costs_only_its_own_group() -> None:
    """int8 keys with one large channel (as models' keys have): the other 64-channel group of
    a row keeps its own step, where one scale per row would err by up to outlier / 254."""
    chunk = make_chunk(3, layers=2, heads=2, kept=32, dim=128)
    chunk.keys[:, 0] = 100.0
    _, back = round_trip(chunk, "int8")
    assert_bound(chunk, back, "int8")
    quiet = chunk.keys[:, 64:].double()
    err = (back.keys[:, 64:].double() - quiet).abs().max()
    bound = quiet.abs().max() / 127  # a whole step of the quiet group's largest value
    assert err <= bound < 100.0 / 254 / 10


@pytest.mark.parametrize("mode", MODES)
def test_zero_rows_and_empty_chunks(mode: str) -> None:
    chunk = make_chunk(2, layers=2, heads=2, kept=8, dim=32)
    chunk.keys[3].zero_()
    chunk.values[5:9].zero_()
    _, back = round_trip(chunk, mode)
    assert torch.equal(back.keys[3], torch.zeros(32)) and not back.keys[3].signbit().any()
    assert torch.equal(back.values[5:9], torch.zeros(4, 32))
    assert_bound(chunk, back, mode)
    # a chunk of zeros only
    zeros = make_chunk(2, layers=1, heads=2, kept=4, dim=16)
    zeros.keys.zero_()
    zeros.values.zero_()
    _, back = round_trip(zeros, mode)
    assert not back.keys.any() and not back.values.any()
    # a chunk where every (layer, head) kept no row
    empty = CompactedChunk(
        torch.zeros(0, 16, dtype=torch.bfloat16),
        torch.zeros(0, 8, dtype=torch.bfloat16),
        torch.zeros(2, 3, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        num_tokens=16,
    )
    raw, back = round_trip(empty, mode)
    assert back.total_kept == 0 and back.keys.shape == (0, 16) and back.values.shape == (0, 8)
    assert len(raw) == frame(raw)[1]  # a payload of 0 bytes


@pytest.mark.parametrize("mode", MODES)
def test_positions_past_65536_tokens_keep_four_bytes(mode: str) -> None:
    """Positions are uint16 up to 65536 tokens and int32 beyond (a chunk that long)."""
    g = torch.Generator().manual_seed(4)
    pos = torch.tensor([0, 40_000, 65_535, 65_536, 69_999], dtype=torch.int32)
    rows = pos.numel()
    chunk = CompactedChunk(
        torch.randn(rows, 8, generator=g),
        torch.randn(rows, 8, generator=g),
        torch.tensor([[rows]], dtype=torch.int32),
        pos,
        num_tokens=70_000,
    )
    raw, back = round_trip(chunk, mode)
    assert len(raw) - frame(raw)[1] == rows * (4 + 8 + 8 + 4)
    assert_bound(chunk, back, mode)
    short = CompactedChunk(chunk.keys, chunk.values, chunk.kept_counts, pos % 65_536, 65_536)
    raw, _ = round_trip(short, mode)
    assert len(raw) - frame(raw)[1] == rows * (2 + 8 + 8 + 4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_mixed_magnitude_keep_their_own_precision(mode: str, dtype: torch.dtype) -> None:
    """Rows from 1e-4 to 1e4 (outlier heads next to quiet ones): each row's error scales
    with its own maximum, so small rows are not flattened by large ones."""
    g = torch.Generator().manual_seed(3)
    rows, dim = 9 * 4, 64
    magnitude = (10.0 ** torch.arange(-4, 5).repeat_interleave(4)).unsqueeze(1)
    keys = (torch.randn(rows, dim, generator=g) * magnitude).to(dtype)
    values = (torch.randn(rows, dim, generator=g) * magnitude.flip(0)).to(dtype)
    keys[0, 0] = 3e3  # one outlier inside a small row: only that row's step grows
    counts = torch.tensor([[rows // 2, rows - rows // 2]], dtype=torch.int32)
    pos = torch.cat([torch.arange(rows // 2), torch.arange(rows - rows // 2)]).to(torch.int32)
    chunk = CompactedChunk(keys, values, counts, pos, num_tokens=rows)
    _, back = round_trip(chunk, mode)
    assert_bound(chunk, back, mode)
    rel = (back.keys.double() - keys.double()).abs().amax(dim=1) / keys.double().abs().amax(dim=1)
    # float16 scales of the 1e-4 rows are subnormal (a coarser step, by a few percent)
    limit = 0.5 / 127 if mode == "int8" else 2.0**-4
    assert (rel <= limit * 1.1 + UNIT_ROUNDOFF[dtype] * 2).all()
    assert (back.keys[4:8].double().abs() > 0).any()  # 1e-3 rows survive


@pytest.mark.parametrize("mode", MODES)
def test_ragged_per_head_counts(mode: str) -> None:
    """Heads keep different numbers of rows (one keeps none): each head's rows and
    positions come back where they were, within the bound."""
    counts = [5, 0, 17, 3, 9, 1]
    chunk = random_ragged(counts, 3, 2, 24, 64, 48, torch.float32, 0)
    chunk = CompactedChunk(
        torch.randn(chunk.total_kept, 64),
        torch.randn(chunk.total_kept, 48) * 4,
        chunk.kept_counts,
        chunk.positions,
        chunk.num_tokens,
    )
    _, back = round_trip(chunk, mode)
    assert back.uniform_count() is None
    assert_bound(chunk, back, mode)
    for layer in range(3):
        for head in range(2):
            k, v, p = back.head(layer, head)
            k0, v0, p0 = chunk.head(layer, head)
            assert k.shape == k0.shape and v.shape == v0.shape and torch.equal(p, p0)


@pytest.mark.skipif("fp8" not in QUANT_DTYPES, reason="needs torch.float8_e4m3fn")
def test_fp8_cast_rounds_to_nearest_even() -> None:
    """The fp8 encoder relies on torch's float32 -> e4m3fn cast rounding to the nearest of
    the 127 finite non-negative e4m3 values, ties to the even code (the 2^-4 bound, and the
    same bytes on every host, need it): checked against a reference built from the codes."""
    codes = torch.arange(127, dtype=torch.uint8)
    grid = codes.view(torch.float8_e4m3fn).double()  # 0 .. 448, increasing
    g = torch.Generator().manual_seed(5)
    y = torch.randn(1 << 16, generator=g) * 10.0 ** torch.randint(-5, 3, (1 << 16,), generator=g)
    ties = (grid[:-1] + grid[1:]) / 2  # every midpoint, exactly representable in float32
    y = torch.cat([y.clamp(-448, 448), ties.float(), -ties.float(), grid.float()])
    got = y.to(torch.float8_e4m3fn).double()
    a = y.double().abs()
    hi = torch.searchsorted(grid, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    even = torch.where(lo % 2 == 0, lo, hi)
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, even))
    assert torch.equal(got, grid[pick] * torch.sign(y.double()))


def test_encode_leaves_the_chunk_alone_and_decodes_into_one_packed_buffer() -> None:
    chunk = make_chunk(4, dim=32)
    before = chunk.clone()
    value, served = ChunkCodec(NS_INT8, quantize="int8").encode_served(chunk)
    assert same_chunk(chunk, before)  # float32 rows are divided in a copy, never in place
    back = ChunkCodec(NS_INT8).decode(value.tobytes())  # any codec reads quantized values
    assert same_chunk(back, served)  # what a reader gets is what the store serves
    assert packed_span(back) is not None and packed_span(served) is not None


def test_unquantizable_chunks_are_stored_raw() -> None:
    """A value float16 scales cannot carry (inf, NaN) or a non-float dtype (an fp8 KV
    cache) is stored as it is: exact, version 2, counted."""
    codec = ChunkCodec(NS_INT8, quantize="int8")
    inf = make_chunk(5)
    inf.keys[2, 3] = float("inf")
    huge = make_chunk(6)
    huge.values[0, 0] = 1e7  # 1e7 / 127 is past float16's 65504
    raw_dtype = make_chunk(7, dtype=torch.uint8)
    for chunk in (inf, huge, raw_dtype):
        value = codec.encode(chunk)
        assert value.quantize is None
        assert same_chunk(codec.decode(value.tobytes()), chunk)
    assert codec.unquantized == 3


# ----------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_payload_is_at_most_052_of_bf16(head_dim: int) -> None:
    """int8 rows + a float16 scale per 64 channels + positions against bf16 rows + int32
    positions."""
    chunk = make_chunk(0, layers=4, heads=2, kept=128, dim=head_dim, dtype=torch.bfloat16)
    value = ChunkCodec(NS_INT8, quantize="int8").encode(chunk)
    _, *payload = value.parts
    quantized = sum(memoryview(p).nbytes for p in payload)
    bf16 = chunk.payload_nbytes  # int32 positions | keys | values
    assert bf16 == chunk.total_kept * (4 + 2 * 2 * head_dim)
    assert quantized == quantized_nbytes(chunk.total_kept, head_dim, head_dim, chunk.num_tokens)
    ratio = quantized / bf16
    assert ratio <= 0.52, ratio
    scales = 2 * 2 * (head_dim // 64)  # keys and values, float16, one per 64 channels
    assert ratio == pytest.approx((2 + 2 * head_dim + scales) / (4 + 4 * head_dim))
    plain = ChunkCodec(NS_PLAIN).encode(chunk)
    assert len(value) / len(plain) <= 0.52  # whole values too (frame heads are ~150 bytes)


# ----------------------------------------------------------------------------- damage
def frame(raw: bytes) -> tuple[int, int]:
    """(header length, payload offset) of a value."""
    hlen = struct.unpack_from("<I", raw, 4)[0]
    return hlen, 8 + hlen + (-(8 + hlen) % 16)


@pytest.mark.parametrize("mode", MODES)
def test_damaged_rows_scales_and_header_are_refused(mode: str) -> None:
    chunk = make_chunk(8, layers=2, heads=2, kept=8, dim=16)
    codec = ChunkCodec(NS_INT8, quantize=mode)
    raw = codec.encode(chunk).tobytes()
    hlen, off = frame(raw)
    n = chunk.total_kept
    rows_at = off + 2 * n  # after uint16 positions
    scales_at = rows_at + n * (16 + 16)
    assert len(raw) - off == scales_at - off + 4 * n

    def flipped(at: int, bit: int = 0) -> bytes:
        return raw[:at] + bytes([raw[at] ^ (1 << bit)]) + raw[at + 1 :]

    for at in (rows_at, rows_at + 17, scales_at - 1):  # key and value rows
        with pytest.raises(ChecksumMismatchError):
            codec.decode(flipped(at))
    for at in (scales_at, scales_at + 1, scales_at + 2 * n + 3, len(raw) - 1):  # scales
        with pytest.raises(ChecksumMismatchError):
            codec.decode(flipped(at, 6))
    # the header's q field: a flipped byte of its text, the other mode, no q, q on version 2
    q_at = raw.index(msgpack.packb(mode), 8, 8 + hlen) + 1
    with pytest.raises(BadHeaderError):
        codec.decode(flipped(q_at, 1))
    other = "fp8" if mode == "int8" else "int8"
    if other in QUANT_DTYPES:
        with pytest.raises(ChecksumMismatchError):  # same payload length, q is checksummed
            codec.decode(rewrite_header(raw, q=other))
    header = msgpack.unpackb(raw[8 : 8 + hlen])
    assert header["v"] == QUANTIZED_VALUE_VERSION and header["q"] == mode
    without_q = {k: v for k, v in header.items() if k != "q"}
    packed = msgpack.packb(without_q, use_bin_type=True)
    no_q = b"LMCK" + struct.pack("<I", len(packed)) + packed
    no_q += bytes(-len(no_q) % 16) + raw[off:]
    with pytest.raises(BadHeaderError, match="needs 'q'"):
        codec.decode(no_q)
    with pytest.raises(BadHeaderError, match="no quantization field"):
        codec.decode(rewrite_header(raw, v=VALUE_VERSION))
    with pytest.raises(BadHeaderError):
        codec.decode(rewrite_header(raw, q="int4"))
    with pytest.raises(BadHeaderError, match="float type"):
        codec.decode(rewrite_header(raw, dt="uint8"))
    with pytest.raises(UnsupportedVersionError):
        codec.decode(rewrite_header(raw, v=QUANTIZED_VALUE_VERSION + 1))
    with pytest.raises(ShapeMismatchError):
        codec.decode(raw + b"\0")
    metrics = codec.metrics()
    assert metrics["checksum_mismatch"] >= 7 and metrics["bad_header"] >= 4


@pytest.mark.parametrize("mode", MODES)
def test_every_single_bit_flip_and_truncation_is_refused(mode: str) -> None:
    """Exhaustive over a small value: any flipped bit outside the alignment padding, and
    any truncation, is refused."""
    chunk = random_ragged([2, 0, 3, 1], 2, 2, 6, 5, 3, torch.bfloat16, 1)
    chunk = CompactedChunk(
        torch.randn(chunk.total_kept, 5).bfloat16(),
        torch.randn(chunk.total_kept, 3).bfloat16(),
        chunk.kept_counts,
        chunk.positions,
        chunk.num_tokens,
    )
    codec = ChunkCodec(NS_INT8, quantize=mode)
    raw = codec.encode(chunk).tobytes()
    hlen, off = frame(raw)
    for at in [i for i in range(len(raw)) if not 8 + hlen <= i < off]:
        for bit in (0, 3, 7):
            with pytest.raises(CorruptEntryError):
                codec.decode(raw[:at] + bytes([raw[at] ^ (1 << bit)]) + raw[at + 1 :])
    for cut in range(len(raw)):
        with pytest.raises(CorruptEntryError):
            codec.decode(raw[:cut])


def test_values_of_the_per_row_scale_format_are_refused() -> None:
    """Version 3 held one scale per row: its bytes read as groups would be wrong KV, so such
    a value is refused (and recomputed), never decoded."""
    assert QUANTIZED_VALUE_VERSION == 4
    codec = ChunkCodec(NS_INT8, quantize="int8")
    raw = codec.encode(make_chunk(2, dim=128)).tobytes()
    with pytest.raises(UnsupportedVersionError):
        codec.decode(rewrite_header(raw, v=3))


def test_version_2_values_still_decode_in_a_quantizing_codec() -> None:
    """Unquantized values keep their version and bytes (entries written before this format
    existed stay readable); the codec reads what a value says it is."""
    chunk = make_chunk(9)
    old = ChunkCodec(NS_INT8).encode(chunk).tobytes()
    assert msgpack.unpackb(old[8 : 8 + frame(old)[0]])["v"] == VALUE_VERSION
    assert same_chunk(ChunkCodec(NS_INT8, quantize="int8").decode(old), chunk)


# ----------------------------------------------------------------------------- the store
def test_store_config_validates_quantize() -> None:
    for mode in MODES:
        assert StoreConfig(quantize=mode).quantize == mode
    with pytest.raises(ValueError, match=r"StoreConfig\.quantize must be None, 'int8' or 'fp8'"):
        StoreConfig(quantize="int4")
    with pytest.raises(ValueError, match="quantize"):
        StoreConfig(quantize="INT8")


@pytest.mark.parametrize("mode", MODES)
def test_store_serves_the_same_rows_from_every_tier(mode: str) -> None:
    """A quantizing store gives the value tier the quantized value and the CPU tier the
    rows it decodes to: a chunk reads the same from either, and a hit in the value tier
    promoted to the CPU tier is that chunk again."""
    chunk = make_chunk(10, layers=2, heads=2, kept=32, dim=64, dtype=torch.bfloat16)
    keys = chunk_keys(list(range(512)), NS_INT8, 256)
    codec = ChunkCodec(NS_INT8, quantize=mode)
    cpu = CPUTier(1 << 24, pin_memory=False)
    values = BytesTier(codec)
    cfg = StoreConfig(quantize=mode, redis_async_writes=False, metrics_log_interval_s=None)
    with TieredStore(NS_INT8, cfg, tiers=[cpu, values]) as store:
        assert store.codec.quantize == mode
        assert store.put(keys[0], chunk)
        stored = values.values[keys[0]]
        assert len(stored) < 0.6 * ChunkCodec(NS_PLAIN).encode(chunk).nbytes
        from_values = codec.decode(stored)
        from_cpu = cpu.get(keys[0])
        assert from_cpu is not None and same_chunk(from_cpu, from_values)
        assert_bound(chunk, from_cpu, mode)
        cpu.clear()
        got = store.get(keys[0])  # from the value tier, promoted
        assert got is not None and same_chunk(got, from_values)
        assert same_chunk(cpu.get(keys[0]), from_values)
        assert store.metrics()["codec_unquantized"] == 0


def test_store_background_writes_send_the_quantized_value() -> None:
    chunk = make_chunk(11, kept=16, dim=32, dtype=torch.bfloat16)
    keys = chunk_keys(list(range(256)), NS_INT8, 256)
    values = BytesTier(ChunkCodec(NS_INT8, quantize="int8"))
    values.name = "redis"  # gets the store's background writer
    cfg = StoreConfig(quantize="int8", metrics_log_interval_s=None)
    with TieredStore(NS_INT8, cfg, tiers=[CPUTier(1 << 22, pin_memory=False), values]) as store:
        assert store.put(keys[0], chunk)
        chunk.keys.zero_()  # the caller reuses its tensors at once
        assert store.flush(10)
        back = values.codec.decode(values.values[keys[0]])
        assert same_chunk(back, store.tier("cpu").get(keys[0]))
        assert back.keys.any()


def test_unquantized_entries_are_never_loaded_under_a_quantized_namespace() -> None:
    """Two stores over one shared value tier (as two engines share Redis): the plain
    store's entries are invisible to the int8 store and the other way round, and a plain
    value written under an int8 key is refused, not loaded."""
    tokens = list(range(256 * 3))
    plain_keys = chunk_keys(tokens, NS_PLAIN, 256)
    int8_keys = chunk_keys(tokens, NS_INT8, 256)
    assert not set(plain_keys) & set(int8_keys)
    chunks = [make_chunk(i, dtype=torch.bfloat16) for i in range(3)]
    shared = BytesTier(ChunkCodec(NS_PLAIN))
    cfg = StoreConfig(redis_async_writes=False, metrics_log_interval_s=None)
    plain = TieredStore(NS_PLAIN, cfg, tiers=[shared])
    plain.put_many(list(zip(plain_keys, chunks, strict=True)))
    assert plain.lookup_prefix(plain_keys) == 3

    quant_view = BytesTier(ChunkCodec(NS_INT8, quantize="int8"))
    quant_view.values = shared.values  # the same bytes, read by the int8 store's codec
    quant = TieredStore(
        NS_INT8,
        StoreConfig(quantize="int8", redis_async_writes=False, metrics_log_interval_s=None),
        tiers=[CPUTier(1 << 22, pin_memory=False), quant_view],
    )
    assert quant.lookup_prefix(int8_keys) == 0
    assert quant.get_many(int8_keys) == [None, None, None]
    # a plain value copied under the int8 key: refused by the namespace check
    shared.values[int8_keys[0]] = shared.values[plain_keys[0]]
    assert quant.get(int8_keys[0]) is None
    assert quant_view.codec.metrics()["foreign_namespace"] == 1
    assert quant_view.stats.snapshot()["rejected"] == 1
    with pytest.raises(ForeignNamespaceError):
        quant.codec.decode(shared.values[plain_keys[0]])
    # the int8 store's own entries load; the plain store never loads them (its keys differ,
    # and its codec refuses their namespace)
    quant.put_many(list(zip(int8_keys[1:], chunks[1:], strict=True)))
    assert quant.tier("cpu").contains(int8_keys[1]) and int8_keys[1] in shared.values
    quant.tier("cpu").clear()
    assert all(c is not None for c in quant.get_many(int8_keys[1:]))
    assert plain.get_many(int8_keys[1:]) == [None, None]
    assert shared.codec.metrics()["foreign_namespace"] == 2
    assert all(c is not None for c in plain.get_many(plain_keys))
    plain.close()
    quant.close()
