"""How far one tensor is from a reference: the one error measure of benchmarks, GPU checks
and GPU tests."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius), computed in float64 on ``want``'s device;
    a zero reference divides by 1e-30 instead (so any difference from it is huge)."""
    denom = float(want.double().norm())
    return float((got.double() - want.double()).norm()) / max(denom, 1e-30)
