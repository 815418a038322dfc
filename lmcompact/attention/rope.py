"""Rotary position embedding (RoPE) as data: frequencies and layout, rotation by position.

Post-RoPE vectors can be moved between positions without the model: ``R(p + d) = R(d) R(p)``,
so ``rotate(x, -p)`` recovers the pre-RoPE vector of a query or key seen at position ``p``
and ``rotate(x_pre, p')`` places it at ``p'``. Only the first ``2 * len(inv_freq)`` dims
rotate (partial rotary); the rest pass through. Two pair layouts exist::

    neox (HF Llama "rotate_half"):   pairs (i, i + R/2)   x = [x1 | x2]
    interleaved (GPT-J):             pairs (2i, 2i + 1)

Engine-free (torch only): the transformers integration reads ``inv_freq`` from the model's
rotary module, the vLLM connector from the model config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rope:
    """One RoPE: ``inv_freq`` ``(R/2,)`` (angle of pair ``i`` at position ``p`` is
    ``p * inv_freq[i]``) and the pair layout."""

    inv_freq: torch.Tensor
    neox: bool = True

    def __post_init__(self) -> None:
        if self.inv_freq.dim() != 1 or self.inv_freq.numel() == 0:
            raise ValueError(
                f"inv_freq must be a non-empty 1-D tensor, got shape {tuple(self.inv_freq.shape)}"
            )

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @classmethod
    def from_theta(cls, theta: float, rotary_dim: int, neox: bool = True) -> Rope:
        """The default (unscaled) RoPE: ``inv_freq[i] = theta ** (-2i / rotary_dim)``."""
        if theta <= 0 or rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(
                f"RoPE needs theta > 0 and an even rotary_dim > 0, got {theta} and {rotary_dim}"
            )
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        return cls(inv_freq=(1.0 / theta**exponents).float(), neox=neox)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., N, D)`` rotated by ``positions`` ``(N,)`` (float, may be negative)."""
        r = self.rotary_dim
        if x.shape[-1] < r:
            raise ValueError(f"vectors of dim {x.shape[-1]} are shorter than rotary_dim {r}")
        angles = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq.to(torch.float64)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # (N, R/2)
        rotated, rest = x[..., :r], x[..., r:]
        if self.neox:
            x1, x2 = rotated[..., : r // 2], rotated[..., r // 2 :]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1)

    def mean_rotation(self, positions: torch.Tensor, dim: int) -> torch.Tensor:
        """``(D, D)`` matrix ``mean_p R(p)`` over ``positions`` (acts on column vectors)."""
        eye = torch.eye(dim, dtype=torch.float64)
        rotated = self.rotate(eye.expand(positions.numel(), dim, dim), positions.view(-1, 1))
        # rotate() acts on rows: row j of rotate(I) is R e_j, i.e. the transpose of R
        return rotated.mean(dim=0).transpose(0, 1)
