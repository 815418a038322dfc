"""The GPU-machine part of ``lmcompact bench store --device cuda``: host <-> device copies.

Per budget, the same chunks are moved both ways, each path against its baseline in the
same round:

* ``d2h``: the save path, ``CPUTier.put_many`` of device chunks (side-stream copies into
  pinned buffers, one event per batch) then ``get_many`` (which waits on it), against
  ``raw_d2h``: one
  ``non_blocking`` copy per chunk of the same bytes from a device buffer into a pinned
  buffer, then a device synchronize;
* ``h2d``: the load path, ``GPUTier.put_many`` of pinned chunks (side-stream copies) then
  ``get_many`` and a device synchronize, against ``raw_h2d``, the plain copies the other way.

Fractions: ``d2h_vs_raw`` / ``h2d_vs_raw`` (median baseline time / median store time:
how close the store gets to what the link does with plain copies), and ``d2h_vs_memcpy`` /
``h2d_vs_memcpy`` (host memcpy time of the same bytes in the same round / store time: the
store's transfer rate as a fraction of the host-copy bandwidth).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcompact.store.chunk import CompactedChunk
from lmcompact.store.tiers.cpu_tier import CPUTier
from lmcompact.store.tiers.gpu_tier import GPUTier

Step = tuple[str, Callable[[], object], Callable[[], object] | None]
STEPS = ("raw_d2h", "d2h", "raw_h2d", "h2d")


class CudaCase:
    """Host <-> device transfers of one budget's chunks.

    Args:
        keys: one store key per chunk.
        chunks: host chunks, each packed in one buffer.
        device: the CUDA device.
    """

    def __init__(
        self, keys: Sequence[Any], chunks: Sequence[CompactedChunk], device: str = "cuda"
    ) -> None:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs CUDA")
        self.device = torch.device(device)
        self.keys = list(keys)
        nbytes = [c.payload_nbytes for c in chunks]
        self.dev_bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in nbytes]
        self.pin_bufs = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in nbytes]
        self.dev_chunks = [c.pack_into(b) for c, b in zip(chunks, self.dev_bufs, strict=True)]
        self.pin_chunks = [c.pack_into(b) for c, b in zip(chunks, self.pin_bufs, strict=True)]
        self.dev_dst = [torch.empty_like(b) for b in self.dev_bufs]
        self.pin_dst = [torch.empty_like(b).pin_memory() for b in self.pin_bufs]
        cap = 2 * sum(nbytes)
        self.pinned_tier = CPUTier(cap, pin_memory=True)
        self.gpu_tier = GPUTier(cap, self.device)
        torch.cuda.synchronize(self.device)

    def steps(self) -> list[Step]:
        return [
            ("raw_d2h", self._raw_d2h, None),
            ("d2h", self._d2h, self._reset(self.pinned_tier)),
            ("raw_h2d", self._raw_h2d, None),
            ("h2d", self._h2d, self._reset(self.gpu_tier)),
        ]

    def _raw_d2h(self) -> None:
        for src, dst in zip(self.dev_bufs, self.pin_dst, strict=True):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(self.device)

    def _raw_h2d(self) -> None:
        for src, dst in zip(self.pin_bufs, self.dev_dst, strict=True):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(self.device)

    def _d2h(self) -> None:
        # the connector's save path: one put_many per request's chunks, then reads
        if not all(self.pinned_tier.put_many(list(zip(self.keys, self.dev_chunks, strict=True)))):
            raise RuntimeError("pinned CPU tier refused a put")
        if any(c is None for c in self.pinned_tier.get_many(self.keys)):  # waits on the event
            raise RuntimeError("pinned CPU tier lost an entry")

    def _h2d(self) -> None:
        if not all(self.gpu_tier.put_many(list(zip(self.keys, self.pin_chunks, strict=True)))):
            raise RuntimeError("GPU tier refused a put")
        if any(c is None for c in self.gpu_tier.get_many(self.keys)):
            raise RuntimeError("GPU tier lost an entry")
        torch.cuda.synchronize(self.device)

    def _reset(self, tier: CPUTier | GPUTier) -> Callable[[], None]:
        def reset() -> None:
            for k in self.keys:
                tier.delete(k)
            torch.cuda.synchronize(self.device)

        return reset


def cuda_row(
    samples: dict[str, list[float]], nbytes: int, ratio: Callable[..., float]
) -> dict[str, Any]:
    """Row fields from the rounds' times (``ratio(samples, base_steps, store_steps, stat)``:
    baseline time over store time)."""
    from statistics import median

    row: dict[str, Any] = {f"{s}_gbps": nbytes / median(samples[s]) / 1e9 for s in STEPS}
    for way in ("d2h", "h2d"):
        row[f"{way}_vs_raw"] = ratio(samples, [f"raw_{way}"], [way], median)
        row[f"{way}_vs_memcpy"] = ratio(samples, ["memcpy"], [way], median)
    row["cuda_device"] = torch.cuda.get_device_name(0)
    return row
