"""Paged caches that hold fp8 K/V: what their bytes mean, and the numbers behind them.

vLLM allocates an fp8 KV cache (``kv_cache_dtype`` ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) as
``uint8`` pages of the usual shape; its cache kernel stores ``fp8(x / scale)`` with one
scale per layer for keys and one for values (1.0 unless the checkpoint or
``calculate_kv_scales`` sets them)::

    page byte  b  ->  value = float(b viewed as float8) * k_scale   (keys; values: v_scale)

The connector moves those bytes untouched: packs, stored chunks and loads copy them, so a
load writes back exactly what the engine wrote. Only scores read numbers: they see the
dequantized keys (:meth:`Fp8Pages.keys`), the values attention itself reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FP8_FORMATS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""vLLM ``kv_cache_dtype`` -> the float8 format of its page bytes (NVIDIA and x86 CPU; ROCm's
``fnuz`` formats are not handled)."""

MANTISSA_BITS: dict[torch.dtype, int] = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def is_fp8(kv_cache_dtype: str) -> bool:
    """Whether vLLM's ``kv_cache_dtype`` option stores K/V as fp8 bytes."""
    return kv_cache_dtype.startswith("fp8")


def fp8_format(kv_cache_dtype: str) -> torch.dtype:
    """The float8 dtype of ``kv_cache_dtype``'s page bytes (ValueError for others)."""
    try:
        return FP8_FORMATS[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not an fp8 format this connector reads; "
            f"known: {sorted(FP8_FORMATS)}"
        ) from None


@dataclass(frozen=True)
class Fp8Pages:
    """How to read the numbers of an fp8 paged cache, layer by layer.

    Attributes:
        element: the float8 dtype of the page bytes.
        k_scales: per layer (model order) the keys' scale.
        v_scales: per layer the values' scale.
    """

    element: torch.dtype
    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]

    @classmethod
    def of(
        cls, kv_cache_dtype: str, k_scales: Sequence[float], v_scales: Sequence[float]
    ) -> Fp8Pages:
        if len(k_scales) != len(v_scales):
            raise ValueError(f"{len(k_scales)} key scales for {len(v_scales)} value scales")
        return cls(fp8_format(kv_cache_dtype), tuple(k_scales), tuple(v_scales))

    @property
    def unit_scales(self) -> bool:
        """Every scale is 1.0 (the bytes alone say the numbers)."""
        return all(s == 1.0 for s in (*self.k_scales, *self.v_scales))

    def keys(self, layer: int, raw: torch.Tensor) -> torch.Tensor:
        """Float32 keys of layer ``layer`` from page bytes ``raw`` (any shape, uint8)."""
        return _decode(raw, self.element, self.k_scales[layer])

    def values(self, layer: int, raw: torch.Tensor) -> torch.Tensor:
        """Float32 values of layer ``layer`` from page bytes ``raw``."""
        return _decode(raw, self.element, self.v_scales[layer])

    def stacked_keys(self, raw: torch.Tensor) -> torch.Tensor:
        """Float32 keys of every layer at once: ``raw`` ``(L, ...)`` uint8, layer first."""
        scales = torch.tensor(self.k_scales, dtype=torch.float32, device=raw.device)
        decoded = raw.view(self.element).float()
        return decoded * scales.view(-1, *([1] * (raw.dim() - 1)))

    def tolerance(self) -> float:
        """Largest relative error of one stored number: one unit in the last place of the
        format (vLLM's CPU kernel truncates toward zero, CUDA's rounds to nearest)."""
        return 2.0 ** -MANTISSA_BITS[self.element]


def _decode(raw: torch.Tensor, element: torch.dtype, scale: float) -> torch.Tensor:
    if raw.dtype != torch.uint8:
        raise ValueError(f"fp8 pages hold uint8 bytes, got {raw.dtype}")
    return raw.view(element).float() * scale
