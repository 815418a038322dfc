"""Error measure shared by the GPU tests."""

from __future__ import annotations

import torch

from lmcompact import compare


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """:func:`lmcompact.compare.rel_err`; a NaN or inf in ``got`` fails (a poisoned slot was
    read, or a kernel overflowed)."""
    assert torch.isfinite(got).all(), "NaN or inf in the output (a poisoned slot was read?)"
    return compare.rel_err(got, want)
