"""The per-head counts of the requests in flight, as device tables a captured kernel reads.

:class:`lmcompact.compaction.per_head_attention.PerHeadAttention` keeps each packed request's
counts on the host (:class:`HeadCounts`); on CUDA the attention that reads dense cells runs
inside vLLM's CUDA graphs, which replay fixed launches over fixed buffers. So the counts live
in fixed-size device tables (one entry per request, up to the engine's most running
requests), and each physical block maps to the entry of the request it starts::

    entries  (num_blocks,)    -1, or the entry of the request whose block 0 it is
    kept     (L, E, Hkv)      kept keys per (layer, entry, head), base included
    cells    (L, E, Hkv)      first dense cell per (layer, entry, head)
    tail     (E,)             slot where the hole was cut (the tail starts)
    base     (E,)             leading slots every head keeps in vLLM's layout

:meth:`DeviceHeadTables.sync` writes only what changed since the last step (a request
loaded, packed or taken back), on the current stream, before the step's forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lmcompact.compaction.host_copies import host_to_device
from lmcompact.kernels.entry_attention import EntryLengths


@dataclass(frozen=True)
class HeadCounts:
    """One packed request's per-head counts and cells.

    Attributes:
        first_block: physical id of its block 0 (its batch-row key, as for holes).
        counts: ``(L, Hkv)`` int64 kept keys per (layer, kv head), ``base`` included.
        reserved: slots before the hole: the ``base`` slots, then the cells.
        cells: ``(L, Hkv)`` int64 first cell of each head's dense keys in the row.
        base: leading slots every head keeps in vLLM's own layout (block aligned).
    """

    first_block: int
    counts: torch.Tensor
    reserved: int
    cells: torch.Tensor
    base: int


class DeviceHeadTables:
    """Fixed device tables of up to ``capacity`` requests' per-head counts.

    Args:
        num_layers, num_kv_heads: the model's.
        num_blocks: physical blocks of the KV pool (the ``entries`` map's size).
        capacity: most requests at once (vLLM's ``max_num_seqs``).
        device: where the KV pool lives.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        num_blocks: int,
        capacity: int,
        device: torch.device,
    ) -> None:
        self.capacity = capacity
        self.entries = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self.kept = torch.zeros(
            num_layers, capacity, num_kv_heads, dtype=torch.int32, device=device
        )
        self.cells = torch.zeros_like(self.kept)
        self.tail = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.base = torch.zeros_like(self.tail)
        # one view per layer, made once: the per-layer launch does no tensor bookkeeping
        self.layers = [
            EntryLengths(self.entries, self.kept[i], self.cells[i], self.tail, self.base)
            for i in range(num_layers)
        ]
        self._slots: dict[str, tuple[int, HeadCounts]] = {}

    @property
    def active(self) -> bool:
        """Whether any request's counts are on the device."""
        return bool(self._slots)

    def sync(self, wanted: Mapping[str, HeadCounts]) -> None:
        """Make the tables hold exactly ``wanted`` (by request id); writes only changes."""
        if len(wanted) == len(self._slots) and all(
            self._slots.get(req_id, (0, None))[1] is counts for req_id, counts in wanted.items()
        ):
            return  # the usual step: nothing loaded, packed or taken back
        for req_id, (_, counts) in list(self._slots.items()):
            if wanted.get(req_id) is not counts:
                self.entries[counts.first_block] = -1
                del self._slots[req_id]
        free = sorted(set(range(self.capacity)) - {slot for slot, _ in self._slots.values()})
        for req_id, counts in wanted.items():
            if req_id in self._slots:
                continue
            if not free:
                raise RuntimeError(
                    f"more than {self.capacity} requests with per-head counts at once "
                    "(the engine's max_num_seqs)"
                )
            slot = free.pop(0)
            # through page-locked memory: a pageable copy would wait for the previous step
            device = self.kept.device
            self.kept[:, slot].copy_(host_to_device(device, counts.counts.to(torch.int32)))
            self.cells[:, slot].copy_(host_to_device(device, counts.cells.to(torch.int32)))
            self.tail[slot] = counts.reserved
            self.base[slot] = counts.base
            self.entries[counts.first_block] = slot  # last: the row turns on with its counts
            self._slots[req_id] = (slot, counts)
