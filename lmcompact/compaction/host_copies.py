"""Host-to-device copies that do not wait for the work already queued on the stream.

A copy from pageable host memory may synchronise with the stream (the driver stages it
through page-locked memory; CUDA's "API synchronization behavior"), which would stall the
host until the GPU has run everything before it. The per-step edits of the block table
(hole cuts, per-head tails) run while the previous step is still on the GPU, so their
small index tensors go through page-locked memory, as vLLM's own step inputs do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether a copy from ``tensor`` may be queued without waiting (page-locked host memory)."""
    return tensor.device.type == "cpu" and tensor.is_pinned()


def on_device(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on ``device``; from page-locked host memory without a per-copy wait."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=is_pinned(tensor))


def host_to_device(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """A small host ``tensor`` on ``device``, through page-locked memory on CUDA."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return on_device(device, tensor)


def values_on_device(
    values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Host ints (a list, or a list of equal-length lists) as a ``dtype`` tensor on
    ``device`` (:func:`host_to_device`)."""
    return host_to_device(device, torch.tensor(values, dtype=dtype))
