"""RaggedKV: compacted K/V stored flat per (sequence, kv_head) with cu_seqlens offsets.

One :class:`RaggedLayer` holds every kept token of one layer for a batch. Segments
are ordered sequence-major, head-minor (segment ``s = b * H + h``)::

    cu_seqlens:  0      3        5   5          9
    keys:       [k k k | k k    |   | k k k k  ]      (N, head_dim)
    positions:  [0 4 9 | 0 9    |   | 1 2 8 9  ]      original positions
    segment:      b0h0   b0h1   b1h0  b1h1           (one empty head)

Heads keep different numbers of tokens; a head may be empty. New decode tokens
are appended to the end of each segment with their logical positions, so
positions stay sorted within a segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcompact.plan import KeepPlan


@dataclass
class RaggedLayer:
    """Kept K/V of one layer for a batch, flat per (sequence, kv_head).

    Attributes:
        keys: ``(N, head_dim)`` kept keys, segment after segment.
        values: ``(N, head_dim)`` kept values.
        positions: ``(N,)`` int64 original positions.
        cu_seqlens: ``(B * H + 1,)`` int64 segment offsets into the flat tensors.
        num_kv_heads: H.
        scores: Optional ``(N,)`` float32 accumulated attention mass per kept
            token (decode-time policies such as H2O read it).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    num_kv_heads: int
    scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.keys.shape[0]
        if self.keys.dim() != 2 or self.values.shape != self.keys.shape:
            raise ValueError(
                f"keys and values must both be (N, head_dim); got {tuple(self.keys.shape)} "
                f"and {tuple(self.values.shape)}"
            )
        if self.positions.shape != (n,) or self.positions.dtype != torch.int64:
            raise ValueError(f"positions must be int64 of shape ({n},), got {self.positions.shape}")
        if self.cu_seqlens.dim() != 1 or (self.cu_seqlens.numel() - 1) % self.num_kv_heads:
            raise ValueError(
                f"cu_seqlens must have B * {self.num_kv_heads} + 1 entries, "
                f"got {self.cu_seqlens.numel()}"
            )
        if int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != n:
            raise ValueError(f"cu_seqlens must run from 0 to N={n}, got {self.cu_seqlens.tolist()}")
        if self.scores is not None and self.scores.shape != (n,):
            raise ValueError(f"scores must have shape ({n},), got {tuple(self.scores.shape)}")

    # ----------------------------------------------------------------- shape
    @property
    def batch_size(self) -> int:
        return (self.cu_seqlens.numel() - 1) // self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.keys.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[0]

    def lengths(self) -> torch.Tensor:
        """``(B, H)`` kept tokens per (sequence, head)."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).view(-1, self.num_kv_heads)

    def segment_ids(self) -> torch.Tensor:
        """``(N,)`` segment index of every flat token."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(
            torch.arange(lengths.numel(), device=lengths.device), lengths
        )

    def segment(self, batch: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys ``(n, D)``, values ``(n, D)`` and positions ``(n,)`` of one (sequence, head)."""
        s = batch * self.num_kv_heads + head
        start, end = int(self.cu_seqlens[s]), int(self.cu_seqlens[s + 1])
        return self.keys[start:end], self.values[start:end], self.positions[start:end]

    def nbytes(self) -> int:
        """Exact bytes held: K, V, positions, offsets and scores."""
        total = sum(
            t.numel() * t.element_size()
            for t in (self.keys, self.values, self.positions, self.cu_seqlens)
        )
        if self.scores is not None:
            total += self.scores.numel() * self.scores.element_size()
        return total

    def kv_nbytes(self) -> int:
        """Bytes of K and V alone (what a dense cache of the same tokens would hold)."""
        return 2 * self.keys.numel() * self.keys.element_size()

    # ---------------------------------------------------------------- writes
    def append(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> RaggedLayer:
        """Return a new layer with ``S`` tokens appended to the end of every segment.

        Args:
            keys: ``(B, H, S, head_dim)``.
            values: ``(B, H, S, head_dim)``.
            positions: ``(B, S)`` logical positions of the new tokens (the same for
                every head of a sequence).
        """
        b, h, s, d = keys.shape
        if (b, h, d) != (self.batch_size, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"appended keys {tuple(keys.shape)} do not match the layer: batch "
                f"{self.batch_size}, kv heads {self.num_kv_heads}, head_dim {self.head_dim}"
            )
        if values.shape != keys.shape or positions.shape != (b, s):
            raise ValueError(
                f"values {tuple(values.shape)} must equal keys {tuple(keys.shape)} and positions "
                f"{tuple(positions.shape)} must be ({b}, {s})"
            )
        segments = b * h
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        new_cu = torch.zeros_like(self.cu_seqlens)
        new_cu[1:] = torch.cumsum(lengths + s, dim=0)
        total = int(new_cu[-1])
        old_dest = torch.arange(self.num_tokens, device=self.keys.device) + s * self.segment_ids()
        new_dest = (new_cu[1:, None] - s + torch.arange(s, device=self.keys.device)).flatten()

        def scatter(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            out = old.new_empty((total, *old.shape[1:]))
            out[old_dest] = old
            out[new_dest] = new.reshape(segments * s, *old.shape[1:]).to(old.dtype)
            return out

        new_positions = positions.to(torch.int64)[:, None, :].expand(b, h, s)
        scores = None
        if self.scores is not None:
            scores = scatter(self.scores, torch.zeros(segments * s, dtype=self.scores.dtype))
        return RaggedLayer(
            keys=scatter(self.keys, keys),
            values=scatter(self.values, values),
            positions=scatter(self.positions, new_positions.to(self.positions.device)),
            cu_seqlens=new_cu,
            num_kv_heads=h,
            scores=scores,
        )

    def gather(self, keep: Sequence[torch.Tensor]) -> RaggedLayer:
        """Keep, per segment, the given segment-local indices (sorted) and drop the rest.

        Args:
            keep: ``B * H`` int64 tensors of segment-local indices to keep.
        """
        if len(keep) != self.cu_seqlens.numel() - 1:
            raise ValueError(f"need {self.cu_seqlens.numel() - 1} index tensors, got {len(keep)}")
        flat: list[torch.Tensor] = []
        counts: list[int] = []
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        for s, idx in enumerate(keep):
            idx = idx.to(torch.int64).cpu()
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= lengths[s]):
                raise ValueError(f"segment {s}: indices outside [0, {lengths[s]})")
            flat.append(idx + int(self.cu_seqlens[s]))
            counts.append(idx.numel())
        index = torch.cat(flat).to(self.keys.device) if flat else torch.empty(0, dtype=torch.int64)
        cu = torch.zeros_like(self.cu_seqlens)
        cu[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), dim=0).to(cu.device)
        return RaggedLayer(
            keys=self.keys[index],
            values=self.values[index],
            positions=self.positions[index],
            cu_seqlens=cu,
            num_kv_heads=self.num_kv_heads,
            scores=None if self.scores is None else self.scores[index],
        )

    def accumulate_scores(self, mass: torch.Tensor) -> None:
        """Add ``(N,)`` attention mass to the per-token cumulative scores (H2O)."""
        if mass.shape != (self.num_tokens,):
            raise ValueError(f"mass must have shape ({self.num_tokens},), got {tuple(mass.shape)}")
        mass = mass.detach().to(torch.float32)
        self.scores = mass.clone() if self.scores is None else self.scores + mass

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense padded view ``(B, H, L, D)`` keys, values, ``(B, H, L)`` positions and mask.

        ``L`` is the longest segment; padding has mask False and position -1.
        """
        lengths = self.lengths()
        b, h = lengths.shape
        width = int(lengths.max()) if lengths.numel() else 0
        seg = self.segment_ids()
        local = torch.arange(self.num_tokens, device=self.keys.device) - self.cu_seqlens[seg]
        keys = self.keys.new_zeros(b * h, width, self.head_dim)
        values = self.values.new_zeros(b * h, width, self.head_dim)
        positions = torch.full((b * h, width), -1, dtype=torch.int64, device=self.keys.device)
        mask = torch.zeros(b * h, width, dtype=torch.bool, device=self.keys.device)
        keys[seg, local] = self.keys
        values[seg, local] = self.values
        positions[seg, local] = self.positions
        mask[seg, local] = True
        shape = (b, h, width)
        return (
            keys.view(*shape, self.head_dim),
            values.view(*shape, self.head_dim),
            positions.view(shape),
            mask.view(shape),
        )

    def to_dense(self, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scatter back to original positions: ``(B, H, length, D)`` K, V and a keep mask.

        Dropped positions are zero with mask False (for tests and debugging).
        """
        lengths = self.lengths()
        b, h = lengths.shape
        if self.num_tokens and int(self.positions.max()) >= length:
            raise ValueError(f"length {length} is shorter than the largest kept position")
        seg = self.segment_ids()
        keys = self.keys.new_zeros(b * h, length, self.head_dim)
        values = self.values.new_zeros(b * h, length, self.head_dim)
        mask = torch.zeros(b * h, length, dtype=torch.bool, device=self.keys.device)
        keys[seg, self.positions] = self.keys
        values[seg, self.positions] = self.values
        mask[seg, self.positions] = True
        return (
            keys.view(b, h, length, -1),
            values.view(b, h, length, -1),
            mask.view(b, h, length),
        )


def ragged_from_dense(
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: Sequence[Sequence[torch.Tensor]],
    positions: torch.Tensor | None = None,
) -> RaggedLayer:
    """Build one layer from dense ``(B, H, T, D)`` K/V and per (sequence, head) kept indices.

    Args:
        keys: ``(B, H, T, D)``.
        values: ``(B, H, T, D)``.
        kept: ``kept[b][h]`` sorted int64 indices into ``T``.
        positions: ``(B, T)`` original positions of the dense tokens; None means arange.
    """
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(
            f"keys and values must be (batch, kv_heads, seq_len, head_dim) and equal; got "
            f"{tuple(keys.shape)} and {tuple(values.shape)}"
        )
    b, h, t, d = keys.shape
    if len(kept) != b or any(len(heads) != h for heads in kept):
        raise ValueError(f"kept indices must be given for {b} sequences x {h} kv heads")
    flat_kept = [idx for heads in kept for idx in heads]
    counts = torch.tensor([idx.numel() for idx in flat_kept], dtype=torch.int64)
    toks = torch.cat([idx.reshape(-1).to(torch.int64) for idx in flat_kept]).to(keys.device)
    if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= t):
        segment = next(i for i, idx in enumerate(flat_kept) if ((idx < 0) | (idx >= t)).any())
        raise ValueError(f"kept[{segment // h}][{segment % h}] has indices outside [0, {t})")
    # One row gather per tensor for the whole layer (no loop over heads): row
    # segment * T + token of the (B*H*T, D) view. index_select on rows is the
    # fastest CPU gather measured, even counting the copy reshape makes of K/V
    # that the model laid out (B, T, H, D).
    segs = torch.repeat_interleave(torch.arange(b * h), counts).to(keys.device)
    rows = segs * t + toks
    flat_k = keys.reshape(b * h * t, d).index_select(0, rows)
    flat_v = values.reshape(b * h * t, d).index_select(0, rows)
    if positions is None:
        flat_pos = toks.clone()
    else:
        flat_pos = positions.to(torch.int64).to(keys.device).reshape(-1)[(segs // h) * t + toks]
    cu = torch.zeros(b * h + 1, dtype=torch.int64, device=keys.device)
    cu[1:] = torch.cumsum(counts.to(keys.device), dim=0)
    return RaggedLayer(flat_k, flat_v, flat_pos, cu, h)


@dataclass
class RaggedKV:
    """Compacted K/V of every layer: a list of :class:`RaggedLayer`."""

    layers: list[RaggedLayer]

    @classmethod
    def from_dense(
        cls,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        plans: Sequence[KeepPlan],
        positions: torch.Tensor | None = None,
    ) -> RaggedKV:
        """Apply one KeepPlan per sequence to dense per-layer ``(B, H, T, D)`` K/V."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} key layers but {len(values)} value layers")
        if not keys:
            raise ValueError("need at least one layer")
        b, h, t, _ = keys[0].shape
        if len(plans) != b:
            raise ValueError(f"need one KeepPlan per sequence: batch {b}, got {len(plans)} plans")
        for plan in plans:
            plan.validate_for(len(keys), h, t)
        layers = [
            ragged_from_dense(k, v, [plan.kept[index] for plan in plans], positions)
            for index, (k, v) in enumerate(zip(keys, values, strict=True))
        ]
        return cls(layers)

    def nbytes(self) -> int:
        """Exact bytes held by every layer (K, V, positions, offsets, scores)."""
        return sum(layer.nbytes() for layer in self.layers)

    def kv_nbytes(self) -> int:
        return sum(layer.kv_nbytes() for layer in self.layers)

    def append(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Append decode tokens ``(B, H, S, D)`` to ``layer`` in place."""
        self.layers[layer] = self.layers[layer].append(keys, values, positions)
