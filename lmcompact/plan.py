"""KeepPlan: which original token positions each (layer, kv_head) keeps.

A plan describes one sequence of ``seq_len`` tokens. For every layer ``l`` and
KV head ``h`` it holds a sorted, duplicate-free int64 tensor of original
positions in ``[0, seq_len)``. Budgets may differ per head and per layer::

    layer 0   head 0: [0 1 2 3 | 17 40 | 120 ... 127]   kept = 14
              head 1: [0 1 2 3 | 9 | 121 ... 127]       kept = 12
    layer 1   ...

Policies produce plans; layouts (RaggedKV, the vLLM connector) apply them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

PLAN_FORMAT_VERSION = 1


def _as_positions(value: torch.Tensor | Sequence[int]) -> torch.Tensor:
    tensor = torch.as_tensor(value, dtype=torch.int64).flatten().cpu()
    return tensor


@dataclass(frozen=True)
class KeepPlan:
    """Kept token positions per (layer, kv_head) for one sequence.

    Attributes:
        seq_len: Number of tokens the plan was made for (T).
        kept: ``kept[layer][head]`` is a 1-D int64 CPU tensor of sorted unique
            original positions in ``[0, seq_len)``.
    """

    seq_len: int
    kept: tuple[tuple[torch.Tensor, ...], ...]

    def __post_init__(self) -> None:
        if self.seq_len < 0:
            raise ValueError(f"seq_len must be >= 0, got {self.seq_len}")
        if not self.kept or not self.kept[0]:
            raise ValueError("a KeepPlan needs at least one layer and one kv head")
        width = len(self.kept[0])
        for layer, heads in enumerate(self.kept):
            if len(heads) != width:
                raise ValueError(
                    f"layer {layer} has {len(heads)} kv heads, layer 0 has {width}; "
                    "every layer must list the same number of heads"
                )
            for head, positions in enumerate(heads):
                self._check_shape(layer, head, positions)
        if not self._all_in_range_and_sorted():
            # the batched check failed: find and name the offending (layer, head)
            for layer, heads in enumerate(self.kept):
                for head, positions in enumerate(heads):
                    self._check_positions(layer, head, positions)

    def _all_in_range_and_sorted(self) -> bool:
        """One device sync for every head (plans made on a GPU hold GPU tensors)."""
        flat = [p for heads in self.kept for p in heads if p.numel()]
        if not flat:
            return True
        if len({p.device for p in flat}) > 1:
            return False  # mixed devices: let the per-head check speak
        joined = torch.cat(flat)
        ok = (joined.min() >= 0) & (joined.max() < self.seq_len)
        if joined.numel() > 1:
            rising = joined[1:] > joined[:-1]
            starts = torch.tensor([p.numel() for p in flat], dtype=torch.int64).cumsum(0)[:-1]
            boundary = torch.zeros(joined.numel() - 1, dtype=torch.bool)
            boundary[starts - 1] = True  # pair (last of one head, first of the next)
            ok = ok & (rising | boundary.to(joined.device)).all()
        return bool(ok)

    def _check_shape(self, layer: int, head: int, positions: torch.Tensor) -> None:
        if positions.dtype != torch.int64 or positions.dim() != 1:
            raise ValueError(
                f"kept[{layer}][{head}] must be a 1-D int64 tensor, got "
                f"{positions.dtype} with shape {tuple(positions.shape)}"
            )

    def _check_positions(self, layer: int, head: int, positions: torch.Tensor) -> None:
        if positions.dtype != torch.int64 or positions.dim() != 1:
            raise ValueError(
                f"kept[{layer}][{head}] must be a 1-D int64 tensor, got "
                f"{positions.dtype} with shape {tuple(positions.shape)}"
            )
        if positions.numel() == 0:
            return
        if int(positions[0]) < 0 or int(positions[-1]) >= self.seq_len:
            raise ValueError(
                f"kept[{layer}][{head}] has positions outside [0, {self.seq_len}): "
                f"min {int(positions.min())}, max {int(positions.max())}"
            )
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise ValueError(f"kept[{layer}][{head}] must be strictly increasing (sorted, unique)")

    # ------------------------------------------------------------------ building
    @classmethod
    def from_lists(
        cls, seq_len: int, kept: Sequence[Sequence[torch.Tensor | Sequence[int]]]
    ) -> KeepPlan:
        """Build a plan from nested lists of positions (sorted and deduplicated here)."""
        layers = tuple(
            tuple(torch.unique(_as_positions(p), sorted=True) for p in heads) for heads in kept
        )
        return cls(seq_len=seq_len, kept=layers)

    @classmethod
    def full(cls, num_layers: int, num_kv_heads: int, seq_len: int) -> KeepPlan:
        """A plan that keeps every token of every head."""
        everything = torch.arange(seq_len, dtype=torch.int64)
        return cls(
            seq_len=seq_len,
            kept=tuple(tuple(everything for _ in range(num_kv_heads)) for _ in range(num_layers)),
        )

    @classmethod
    def from_masks(cls, masks: torch.Tensor) -> KeepPlan:
        """Build a plan from a boolean keep mask of shape ``(layers, kv_heads, seq_len)``."""
        if masks.dim() != 3 or masks.dtype != torch.bool:
            raise ValueError(
                f"masks must be bool with shape (layers, kv_heads, seq_len), got "
                f"{masks.dtype} {tuple(masks.shape)}"
            )
        masks = masks.cpu()
        return cls(
            seq_len=masks.shape[-1],
            kept=tuple(
                tuple(torch.nonzero(m, as_tuple=False).flatten() for m in layer) for layer in masks
            ),
        )

    def with_recent(self, layers: Iterable[int], count: int) -> KeepPlan:
        """A copy whose ``layers`` keep their ``count`` most recent tokens, every head.

        Sliding-window layers of a model need this after compaction inside vLLM: its kernel
        masks the window by key index, which equals the logical distance only when the
        kept tokens are a contiguous suffix packed in order (see ``lmcompact/compaction/holes.py``).
        Applied after ``policy.plan`` so every policy gets it; other layers are untouched.

        Args:
            layers: layer indices to override (out-of-range indices raise).
            count: tokens kept, ``1 <= count <= seq_len``.
        """
        chosen = sorted(set(layers))
        if not chosen:
            return self
        if not 1 <= count <= self.seq_len:
            raise ValueError(f"count must be in [1, {self.seq_len}], got {count}")
        if chosen[0] < 0 or chosen[-1] >= self.num_layers:
            raise ValueError(f"layers {chosen} outside [0, {self.num_layers})")
        recent = torch.arange(self.seq_len - count, self.seq_len, dtype=torch.int64)
        override = set(chosen)
        return KeepPlan(
            seq_len=self.seq_len,
            kept=tuple(
                tuple(recent for _ in heads) if layer in override else heads
                for layer, heads in enumerate(self.kept)
            ),
        )

    # ---------------------------------------------------------------- queries
    @property
    def num_layers(self) -> int:
        return len(self.kept)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kept[0])

    def kept_counts(self) -> torch.Tensor:
        """Kept tokens per (layer, head) as an int64 tensor of shape ``(layers, kv_heads)``."""
        return torch.tensor([[p.numel() for p in heads] for heads in self.kept], dtype=torch.int64)

    @property
    def total_kept(self) -> int:
        return int(self.kept_counts().sum())

    @property
    def total_slots(self) -> int:
        """Token slots of the uncompacted cache: layers x heads x seq_len."""
        return self.num_layers * self.num_kv_heads * self.seq_len

    @property
    def compression_ratio(self) -> float:
        """Kept fraction of the full cache (1.0 keeps everything, 0.25 keeps a quarter)."""
        return self.total_kept / self.total_slots if self.total_slots else 1.0

    @property
    def is_uniform(self) -> bool:
        """True when every (layer, head) keeps the same number of tokens."""
        counts = self.kept_counts()
        return bool((counts == counts.flatten()[0]).all())

    def bytes_saved(self, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes freed by dropping tokens (keys and values)."""
        per_token = 2 * head_dim * torch.empty((), dtype=dtype).element_size()
        return (self.total_slots - self.total_kept) * per_token

    def masks(self) -> torch.Tensor:
        """Boolean keep mask of shape ``(layers, kv_heads, seq_len)``."""
        out = torch.zeros(self.num_layers, self.num_kv_heads, self.seq_len, dtype=torch.bool)
        for layer, heads in enumerate(self.kept):
            for head, positions in enumerate(heads):
                out[layer, head, positions] = True
        return out

    def validate_for(self, num_layers: int, num_kv_heads: int, seq_len: int | None = None) -> None:
        """Raise ValueError unless the plan fits a model of this shape."""
        if self.num_layers != num_layers or self.num_kv_heads != num_kv_heads:
            raise ValueError(
                f"plan is for {self.num_layers} layers x {self.num_kv_heads} kv heads, "
                f"the cache has {num_layers} layers x {num_kv_heads} kv heads"
            )
        if seq_len is not None and self.seq_len != seq_len:
            raise ValueError(f"plan is for {self.seq_len} tokens, the cache holds {seq_len}")

    # ---------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (ints and lists only) for msgpack or JSON."""
        return {
            "version": PLAN_FORMAT_VERSION,
            "seq_len": self.seq_len,
            "kept": [[p.tolist() for p in heads] for heads in self.kept],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KeepPlan:
        """Inverse of :meth:`to_dict`; raises ValueError on foreign or malformed data."""
        if not isinstance(data, dict) or data.get("version") != PLAN_FORMAT_VERSION:
            raise ValueError(
                f"not a KeepPlan dict of version {PLAN_FORMAT_VERSION}: "
                f"version={data.get('version') if isinstance(data, dict) else type(data)}"
            )
        kept = data.get("kept")
        if not isinstance(kept, list) or not all(isinstance(h, list) for h in kept):
            raise ValueError("KeepPlan dict needs 'kept' as a list of per-layer lists")
        layers = tuple(tuple(torch.tensor(p, dtype=torch.int64) for p in heads) for heads in kept)
        return cls(seq_len=int(data["seq_len"]), kept=layers)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeepPlan):
            return NotImplemented
        return (
            self.seq_len == other.seq_len
            and self.num_layers == other.num_layers
            and self.num_kv_heads == other.num_kv_heads
            and all(
                torch.equal(a, b)
                for la, lb in zip(self.kept, other.kept, strict=True)
                for a, b in zip(la, lb, strict=True)
            )
        )

    __hash__ = None  # type: ignore[assignment]
