"""Quantized payloads of stored chunks: int8 or fp8 rows with one scale per 64 channels.

Every stored row is one token of one ``(layer, kv head)``: a row of ``keys`` (``k_dim``
values) or of ``values`` (``v_dim``). A row is cut into groups of :data:`SCALE_GROUP`
channels (the whole row when 64 does not divide its length; :func:`scale_groups`), and each
group is quantized on its own, symmetric, with the scale ``s = absmax(group) / QMAX``
(``QMAX`` 127 for int8, 448 for fp8 e4m3fn):

* ``int8``: ``q = round(x / s)`` (in ``[-127, 127]``); ``|x - q s| <= s / 2`` per element.
* ``fp8``: ``q = float8_e4m3fn(x / s)``; 3 mantissa bits, so the error is at most ``2^-4``
  of ``|x|`` for normal values (``|x / s| >= 2^-6``) and at most ``2^-10 s`` below that.

Groups rather than whole rows because keys carry outlier channels, whose row maximum would
set every channel's step (docs/benchmarks/store-quantization-cpu.md has the errors of
both); a group costs 2 bytes per token. Scales are float16, rounded UP from ``absmax /
QMAX`` (so no element is clipped and the bounds hold with the stored scale; it exceeds
``absmax / QMAX`` by at most ``2^-10`` of itself, or by float16's subnormal spacing
``2^-24`` for groups under ``2^-14 QMAX``). float16 rather than float32 because the scales
are a fixed share of every token's payload next to ``k_dim + v_dim`` bytes of rows: with
float32 scales a head_dim-64 chunk cannot stay under 0.52x of its bf16 bytes (nor with
groups of 32); float16 keeps 11 significant bits (bfloat16: 8) and covers group maxima up
to 8.3e6 (int8) / 2.9e7 (fp8). A chunk with a larger, infinite or NaN value, or whose
dtype is not a float type (an fp8 KV cache), is stored unquantized
(:func:`quantize_payload` returns None).

Payload layout (no padding; the frame around it is :mod:`lmcompact.store.codec`'s)::

    positions   uint16 (n,) when num_tokens <= 65536, else int32 (n,)
    key rows    (n, k_dim) int8 / float8_e4m3fn
    value rows  (n, v_dim)
    key scales  float16 (n, scale_groups(k_dim))
    value scales float16 (n, scale_groups(v_dim))

Positions are chunk-relative (``< num_tokens``), so two bytes hold them for any chunk size
up to 65536: with int32 positions a head_dim-64 row would not reach 0.52x either
(``4 + 128 + 4`` of ``4 + 256`` bytes). Decoding writes the dequantized rows (computed in
float32, then rounded once to the chunk's dtype) and int32 positions into one packed buffer
(:func:`lmcompact.store.chunk.unpack_views`), as the memory tiers hold chunks.
"""

from __future__ import annotations

import torch

from lmcompact.store.chunk import CompactedChunk, packed_nbytes, unpack_views

QUANT_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8}
if hasattr(torch, "float8_e4m3fn"):
    QUANT_DTYPES["fp8"] = torch.float8_e4m3fn
QUANT_MODES = ("int8", "fp8")
"""Quantization names (``"fp8"`` needs a torch with ``float8_e4m3fn``)."""
QMAX = {"int8": 127.0, "fp8": 448.0}
SCALE_DTYPE = torch.float16
SCALE_GROUP = 64
"""Channels of a row that share one scale (bytes per token: 2 more per group than one scale
per row; 64 keeps head dims 64, 128 and 256 at <= 0.52x of bf16)."""
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Chunk dtypes that are quantized; chunks of other dtypes are stored as they are."""
_CPU_BLOCK_ELEMENTS = 1 << 16
"""On the CPU rows are (de)quantized in blocks of about this many elements, so the float32
temporaries stay in cache (several times faster than whole tensors, measured); on a GPU in
one go (a block loop there is kernel launches)."""


def _block_rows(device: torch.device, dim: int) -> int:
    return max(1, _CPU_BLOCK_ELEMENTS // dim) if device.type == "cpu" else 1 << 62


def check_quantize(mode: str | None, where: str = "quantize") -> str | None:
    """``mode`` when it names a quantization this torch can store (or is None), else
    ValueError naming ``where``."""
    if mode is None:
        return None
    if mode not in QUANT_MODES:
        raise ValueError(f"{where} must be None, 'int8' or 'fp8', got {mode!r}")
    if mode not in QUANT_DTYPES:
        raise ValueError(f"{where}={mode!r} needs torch.float8_e4m3fn (torch {torch.__version__})")
    return mode


def scale_groups(dim: int) -> int:
    """Scales of one stored row of ``dim`` values: one per :data:`SCALE_GROUP` channels when
    that divides ``dim``, else one for the row."""
    return dim // SCALE_GROUP if dim % SCALE_GROUP == 0 else 1


def position_bytes(num_tokens: int) -> int:
    """Bytes of one stored position in a quantized payload (2 up to 65536 tokens)."""
    return 2 if num_tokens <= 1 << 16 else 4


def quantized_nbytes(total_kept: int, k_dim: int, v_dim: int, num_tokens: int) -> int:
    """Bytes of a quantized payload (positions, rows, float16 scales of every group)."""
    scales = scale_groups(k_dim) + scale_groups(v_dim)
    return total_kept * (position_bytes(num_tokens) + k_dim + v_dim + scales * SCALE_DTYPE.itemsize)


def _sections(
    payload: torch.Tensor, n: int, dk: int, dv: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions, key rows, value rows, key scales, value scales)`` of a payload; rows
    and scales as uint8 views, rows as ``(n * groups, dim / groups)`` (one group a row) and
    scales flat (2 bytes a group; they may sit at odd offsets)."""
    pb = position_bytes(num_tokens)
    gk, gv = scale_groups(dk), scale_groups(dv)
    a = pb * n
    b = a + n * dk
    c = b + n * dv
    d = c + 2 * n * gk
    positions = payload[:a].view(torch.uint16 if pb == 2 else torch.int32)
    keys = payload[a:b].view(n * gk, dk // gk)
    values = payload[b:c].view(n * gv, dv // gv)
    return positions, keys, values, payload[c:d], payload[d : d + 2 * n * gv]


def _quantize_rows(
    x: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor, mode: str
) -> torch.Tensor:
    """Quantize ``x``'s rows into ``rows`` (uint8 view) and their float16 scales into
    ``scales`` (uint8 view, 2 bytes a group); returns a bool tensor, False when some scale is
    not finite (then the payload must not be used).

    The scale is ``absmax / qmax`` rounded up to float16, so ``|x| / s <= qmax``: int8's
    ``round`` stays within +-127 and fp8's cast within +-448 without a clamp. A zero
    row has scale 0 and quantizes to zeros. Every step is exact or correctly rounded
    (divisions by tensors, never by a scalar), so CPU and CUDA write the same bytes.
    """
    x = x.reshape(rows.shape)  # one group a row
    n, d = x.shape
    finite = torch.ones((), dtype=torch.bool, device=x.device)
    if n == 0 or d == 0:
        scales.zero_()
        return finite
    qmax = QMAX[mode]
    out = rows.view(QUANT_DTYPES[mode])
    step = _block_rows(x.device, d)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        block = x[lo:hi]
        amax = block.abs().amax(dim=1).float()
        # the smallest float16 s with s * qmax >= amax: from an approximate quotient (CUDA
        # divides by a scalar through its reciprocal), then one step up where the exact
        # product (11 by at most 7 significant bits) says it is short, so every device
        # picks the same scale
        s = (amax / qmax).to(SCALE_DTYPE)
        short = s.float() * qmax < amax
        s = torch.where(short, torch.nextafter(s, torch.full_like(s, torch.inf)), s)
        finite &= torch.isfinite(s).all()
        scales[2 * lo : 2 * hi].copy_(s.view(torch.uint8))
        y = torch.div(block, torch.where(s == 0, 1.0, s.float())[:, None])  # float32, a copy
        if mode == "int8":
            y.round_()  # half to even; then exact integers, cast without loss
        out[lo:hi].copy_(y)  # fp8: torch's cast, round to nearest even
    return finite


def _fp8_as_half(codes: torch.Tensor) -> torch.Tensor:
    """float8 e4m3fn codes (uint8) as float16 values ``/ 256``: sign and the 7 other bits
    moved into float16's layout (exact for every finite code, subnormals included; NaN codes,
    which the encoder never writes, read as +-480). Several times faster on CPUs than
    torch's own float8 conversion."""
    sign = (codes >> 7).to(torch.int16) * -32768  # 0x8000 without a signed overflow
    return (((codes & 0x7F).to(torch.int16) << 7) | sign).view(torch.float16)


def _dequantize_rows(
    rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, mode: str
) -> None:
    """Write ``rows * scale`` (computed in float32, rounded once to ``out``'s dtype) into
    ``out``; ``rows`` (one group a row) and ``scales`` are uint8 views of a payload."""
    out = out.view(rows.shape)  # a fresh packed buffer's rows: contiguous
    n, d = rows.shape
    if n == 0 or d == 0:
        return
    s = scales.clone().view(SCALE_DTYPE).float()  # cloned: the bytes may be misaligned
    if mode == "fp8":
        s.mul_(256.0)  # undoes _fp8_as_half's 2^-8 (exact: a power of two)
    q = rows.view(torch.int8)
    step = _block_rows(rows.device, d)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        src = q[lo:hi] if mode == "int8" else _fp8_as_half(rows[lo:hi])
        torch.mul(src, s[lo:hi, None], out=out[lo:hi])


def quantize_payload(chunk: CompactedChunk, mode: str) -> torch.Tensor | None:
    """The quantized payload of ``chunk`` (uint8, on the chunk's device), or None when the
    chunk is stored unquantized (not a float dtype, or a value float16 scales cannot
    carry: infinite, NaN or too large)."""
    if chunk.dtype not in FLOAT_DTYPES:
        return None
    n, dk, dv = chunk.total_kept, int(chunk.keys.shape[1]), int(chunk.values.shape[1])
    nt = chunk.num_tokens
    payload = torch.empty(quantized_nbytes(n, dk, dv, nt), dtype=torch.uint8, device=chunk.device)
    positions, keys, values, k_scales, v_scales = _sections(payload, n, dk, dv, nt)
    positions.copy_(chunk.positions)
    finite = _quantize_rows(chunk.keys, keys, k_scales, mode)
    finite &= _quantize_rows(chunk.values, values, v_scales, mode)
    return payload if bool(finite) else None


def dequantize_payload(
    payload: torch.Tensor,
    kept_counts: torch.Tensor,
    num_tokens: int,
    k_dim: int,
    v_dim: int,
    mode: str,
    dtype: torch.dtype,
) -> CompactedChunk:
    """The chunk a quantized ``payload`` (uint8, any device, checked by the caller) stands
    for, in ``dtype``, in one fresh packed buffer on the payload's device."""
    n = int(kept_counts.sum())
    positions, keys, values, k_scales, v_scales = _sections(payload, n, k_dim, v_dim, num_tokens)
    buf = torch.empty(
        packed_nbytes(n, k_dim, v_dim, dtype.itemsize), dtype=torch.uint8, device=payload.device
    )
    out_pos, out_k, out_v = unpack_views(buf, n, k_dim, v_dim, dtype)
    out_pos.copy_(positions)
    _dequantize_rows(keys, k_scales, out_k, mode)
    _dequantize_rows(values, v_scales, out_v, mode)
    return CompactedChunk._trusted(out_k, out_v, kept_counts, out_pos, num_tokens)
