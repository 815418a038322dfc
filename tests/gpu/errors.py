"""Error measure shared by the GPU tests."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float32; a NaN or inf in ``got`` fails (a poisoned
    slot was read, or a kernel overflowed)."""
    assert torch.isfinite(got).all(), "NaN or inf in the output (a poisoned slot was read?)"
    denom = want.float().norm().item()
    return (got.float() - want.float()).norm().item() / max(denom, 1e-12)
