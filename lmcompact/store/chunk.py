"""``CompactedChunk``: the KV of one chunk of tokens after compaction, engine-agnostic.

Ragged per-head data is kept flat. For a chunk of ``num_tokens`` tokens, every
``(layer, kv_head)`` keeps ``kept_counts[layer, head]`` of them; their rows are laid out
one owner after another, (layer, head)-major, kept tokens in original order::

    row     0 .. c[0,0]-1 | c[0,0] .. c[0,0]+c[0,1]-1 | ... | .. total_kept-1
    owner   (layer 0, h 0) | (layer 0, h 1)             | ... | (L-1, H-1)

so a dense ``(num_layers, num_kv_heads, kept, head_dim)`` tensor is the same memory as the
flat ``(num_layers * num_kv_heads * kept, head_dim)`` one when every head keeps ``kept``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Dtypes a chunk may hold (and the codec may carry), by their wire name.
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        SUPPORTED_DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SUPPORTED_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of ``dtype``; ValueError when the store does not carry it."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} is not supported by the store; allowed: {sorted(SUPPORTED_DTYPES)}"
        ) from None


@dataclass(frozen=True, eq=False)
class CompactedChunk:
    """Compacted KV of one chunk, for every layer and kv head.

    Attributes:
        keys: ``(total_kept, k_head_dim)``, post-RoPE keys, rows laid out as in the module doc.
        values: ``(total_kept, v_head_dim)``, same dtype and device as ``keys``.
        kept_counts: ``(num_layers, num_kv_heads)`` int32 on CPU; sums to ``total_kept``.
        positions: ``(total_kept,)`` int32, same device as ``keys``: each kept row's original
            position RELATIVE TO THE CHUNK START, in ``[0, num_tokens)``. The absolute
            position is ``chunk_index * chunk_size + positions``.
        num_tokens: tokens in the chunk before compaction.

    Tensors are treated as immutable once a chunk is handed to the store: tiers return
    views of what they hold, and callers copy out of them (e.g. into a paged KV cache).
    """

    keys: torch.Tensor
    values: torch.Tensor
    kept_counts: torch.Tensor
    positions: torch.Tensor
    num_tokens: int

    def __post_init__(self) -> None:
        k, v, kc, pos = self.keys, self.values, self.kept_counts, self.positions
        if k.dim() != 2 or v.dim() != 2:
            raise ValueError(
                f"keys and values must be 2-D (total_kept, head_dim); got {tuple(k.shape)} "
                f"and {tuple(v.shape)}"
            )
        if k.shape[0] != v.shape[0] or k.dtype != v.dtype or k.device != v.device:
            raise ValueError(
                f"keys {tuple(k.shape)} {k.dtype} {k.device} and values {tuple(v.shape)} "
                f"{v.dtype} {v.device} must share rows, dtype and device"
            )
        dtype_name(k.dtype)
        if kc.dim() != 2 or kc.dtype != torch.int32 or kc.device.type != "cpu":
            raise ValueError(
                f"kept_counts must be an int32 CPU tensor (num_layers, num_kv_heads); got "
                f"{tuple(kc.shape)} {kc.dtype} {kc.device}"
            )
        if pos.shape != (k.shape[0],) or pos.dtype != torch.int32:
            raise ValueError(
                f"positions must be int32 of shape ({k.shape[0]},); got {tuple(pos.shape)} "
                f"{pos.dtype}"
            )
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        total = int(kc.sum())
        if total != k.shape[0]:
            raise ValueError(f"kept_counts sum to {total} but keys have {k.shape[0]} rows")

    # -- shape helpers -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.kept_counts.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.kept_counts.shape[1])

    @property
    def total_kept(self) -> int:
        return int(self.keys.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def payload_nbytes(self) -> int:
        """Bytes of positions + keys + values (what a tier stores and the codec ships)."""
        return packed_nbytes(
            self.total_kept, self.keys.shape[1], self.values.shape[1], self.keys.element_size()
        )

    def offsets(self) -> list[int]:
        """Row offsets of every (layer, head) owner, length ``num_layers * num_kv_heads + 1``."""
        out = [0]
        for c in self.kept_counts.flatten().tolist():
            out.append(out[-1] + c)
        return out

    def head(self, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``(keys (kept, k_dim), values (kept, v_dim), positions (kept,))`` of one head."""
        flat = layer * self.num_kv_heads + head
        counts = self.kept_counts.flatten()
        start = int(counts[:flat].sum())
        stop = start + int(counts[flat])
        return self.keys[start:stop], self.values[start:stop], self.positions[start:stop]

    def uniform_count(self) -> int | None:
        """The per-head kept count when all heads keep the same number, else None."""
        first = int(self.kept_counts.flatten()[0])
        return first if bool((self.kept_counts == first).all()) else None

    # -- dense convenience ---------------------------------------------------------------
    @classmethod
    def from_dense(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor | None = None,
        num_tokens: int | None = None,
    ) -> CompactedChunk:
        """Build a chunk where every (layer, head) keeps the same number of tokens.

        Args:
            keys: ``(num_layers, num_kv_heads, kept, k_head_dim)``.
            values: ``(num_layers, num_kv_heads, kept, v_head_dim)``.
            positions: ``(num_layers, num_kv_heads, kept)`` or ``(kept,)`` (shared by all
                heads) chunk-relative positions; None means no token was dropped
                (``arange(kept)``).
            num_tokens: chunk length before compaction; defaults to ``kept``.
        """
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"dense keys/values must be (layers, heads, kept, dim) with equal leading "
                f"dims; got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        layers, heads, kept, _ = keys.shape
        n = kept if num_tokens is None else num_tokens
        if positions is None:
            if kept != n:
                raise ValueError(f"positions are required when kept ({kept}) != num_tokens ({n})")
            positions = torch.arange(kept, dtype=torch.int32, device=keys.device)
        if positions.dim() == 1:
            positions = positions.expand(layers, heads, kept)
        if positions.shape != (layers, heads, kept):
            raise ValueError(
                f"positions must be ({kept},) or ({layers}, {heads}, {kept}); got "
                f"{tuple(positions.shape)}"
            )
        return cls(
            keys=keys.reshape(layers * heads * kept, keys.shape[3]),
            values=values.reshape(layers * heads * kept, values.shape[3]),
            kept_counts=torch.full((layers, heads), kept, dtype=torch.int32),
            positions=positions.to(torch.int32).reshape(-1),
            num_tokens=n,
        )

    def to_dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``(keys (L, H, kept, k_dim), values (L, H, kept, v_dim), positions (L, H, kept))``.

        Raises:
            ValueError: when heads keep different numbers of tokens.
        """
        kept = self.uniform_count()
        if kept is None:
            raise ValueError("to_dense needs a uniform kept count; this chunk is ragged")
        lh = (self.num_layers, self.num_kv_heads, kept)
        return (
            self.keys.view(*lh, self.keys.shape[1]),
            self.values.view(*lh, self.values.shape[1]),
            self.positions.view(*lh),
        )

    # -- copies ----------------------------------------------------------------------------
    def clone(self, device: str | torch.device | None = None) -> CompactedChunk:
        """A copy in one fresh packed buffer on ``device`` (default: this chunk's)."""
        buf = torch.empty(self.payload_nbytes, dtype=torch.uint8, device=device or self.device)
        return self.pack_into(buf)

    def pack_into(self, buffer: torch.Tensor) -> CompactedChunk:
        """Copy positions | keys | values into ``buffer`` (uint8, ``payload_nbytes`` long).

        Returns:
            A chunk whose tensors are views of ``buffer`` (kept_counts is shared: chunks
            are immutable once stored).
        """
        out = unpack_views(
            buffer,
            self.total_kept,
            self.keys.shape[1],
            self.values.shape[1],
            self.dtype,
        )
        out[0].copy_(self.positions)
        out[1].copy_(self.keys)
        out[2].copy_(self.values)
        return CompactedChunk._trusted(out[1], out[2], self.kept_counts, out[0], self.num_tokens)

    @classmethod
    def _trusted(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        kept_counts: torch.Tensor,
        positions: torch.Tensor,
        num_tokens: int,
    ) -> CompactedChunk:
        """Build without re-validating (copies of an already validated chunk)."""
        obj = object.__new__(cls)
        for name, value in (
            ("keys", keys),
            ("values", values),
            ("kept_counts", kept_counts),
            ("positions", positions),
            ("num_tokens", num_tokens),
        ):
            object.__setattr__(obj, name, value)
        return obj


def packed_nbytes(total_kept: int, k_dim: int, v_dim: int, element_size: int) -> int:
    """Bytes of the packed layout ``positions int32 | keys | values``."""
    return total_kept * (4 + element_size * (k_dim + v_dim))


def unpack_views(
    buffer: torch.Tensor, total_kept: int, k_dim: int, v_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Carve ``(positions, keys, values)`` views out of a packed uint8 ``buffer``.

    Sections start at multiples of 4 bytes then of the element size, so the dtype views are
    aligned whenever ``buffer`` itself is.
    """
    elt = dtype.itemsize
    a = 4 * total_kept
    b = a + elt * total_kept * k_dim
    c = b + elt * total_kept * v_dim
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != c:
        raise ValueError(
            f"buffer must be 1-D uint8 of {c} bytes; got {tuple(buffer.shape)} {buffer.dtype}"
        )
    positions = buffer[:a].view(torch.int32)
    keys = buffer[a:b].view(dtype).view(total_kept, k_dim)
    values = buffer[b:c].view(dtype).view(total_kept, v_dim)
    return positions, keys, values


def packed_span(chunk: CompactedChunk) -> torch.Tensor | None:
    """The chunk's payload as one uint8 tensor when it already lies packed in one buffer
    (``positions | keys | values`` back to back, as the tiers store it), else None.

    Returns:
        A ``(chunk.payload_nbytes,)`` uint8 view of the chunk's memory (no copy).
    """
    p, k, v = chunk.positions, chunk.keys, chunk.values
    if not (p.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return None
    base = p.untyped_storage().data_ptr()
    if k.untyped_storage().data_ptr() != base or v.untyped_storage().data_ptr() != base:
        return None
    if p.data_ptr() + p.nbytes != k.data_ptr() or k.data_ptr() + k.nbytes != v.data_ptr():
        return None
    first = p.view(torch.uint8)
    return first.as_strided((chunk.payload_nbytes,), (1,), first.storage_offset())
