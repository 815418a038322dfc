"""A ring of page-locked slots that a many-chunk get copies quantized payloads through.

A copy from pageable host memory to the GPU is synchronous and runs at a fraction of the
bus (CUDA stages it through a small driver buffer): on the H100 a 16k-token stored prefix
of the 8B shape (63 int8 chunks, 256 MiB) spent 0.047 s there, a third of its hit. Values
stay pageable ``bytes`` at rest (a page-locked allocation per saved value costs far more,
``docs/benchmarks/connector-default-h200.md``); instead a get sends them through a few
page-locked slots owned by the tier::

    worker thread, chunk i   verify the value; wait until chunk i - S's copy out of slot
                             i % S finished; copy the payload into the slot
    caller, chunk i          wait for that; copy the slot to the GPU (asynchronous, on the
                             caller's stream); record an event for the slot; dequantize

so the checksums, the host copies into the slots and the copies to the GPU overlap, and no
allocation happens per get. :meth:`StagingRing.stage` is the worker side,
:meth:`StagingRing.issued` the caller's; every get ends with :meth:`StagingRing.close` (no
worker waits for a copy that never comes) and, once its workers returned,
:meth:`StagingRing.release`.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class CopyDone(Protocol):
    """What marks a copy out of a slot as finished (a ``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


class RingClosed(Exception):
    """The get this slot was for stopped; nothing was staged."""


class StagingRing:
    """``slots`` page-locked buffers of ``slot_bytes`` each, used in turn by chunk index.

    Args:
        slot_bytes: bytes of one slot (a payload larger than this is not staged).
        slots: how many (at least the verifying threads, so each has one to fill).
        pin_memory: page-locked (False only where CUDA is absent: tests of the order).

    One get at a time (:meth:`begin` returns False while another one runs).
    """

    def __init__(self, slot_bytes: int, slots: int, pin_memory: bool = True) -> None:
        if slot_bytes < 1 or slots < 1:
            raise ValueError(f"need positive slot_bytes and slots, got {slot_bytes}, {slots}")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.buffer = torch.empty(slots, slot_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._done: list[CopyDone | None] = [None] * slots  # last copy out of each slot
        self._cond = threading.Condition()
        self._busy = threading.Lock()
        self._issued = 0  # chunks of the current get handled by the caller, in order
        self._closed = False

    def begin(self) -> bool:
        """Claim the ring for one get; False when another get holds it."""
        if not self._busy.acquire(blocking=False):
            return False
        with self._cond:
            self._issued = 0
            self._closed = False
        return True

    def stage(self, index: int, payload: torch.Tensor) -> torch.Tensor:
        """Worker side: copy ``payload`` (uint8, at most ``slot_bytes``) into chunk
        ``index``'s slot once the slot's previous copy finished; returns the slot's view.

        Raises:
            RingClosed: the get stopped before this slot came free.
        """
        if payload.numel() > self.slot_bytes:
            raise ValueError(f"{payload.numel()} bytes do not fit a {self.slot_bytes}-byte slot")
        slot = index % self.slots
        with self._cond:
            # the slot's previous user in this get is chunk index - slots
            self._cond.wait_for(lambda: self._closed or self._issued > index - self.slots)
            if self._closed:
                raise RingClosed(f"chunk {index}")
            done = self._done[slot]
        if done is not None:
            done.synchronize()
        view = self.buffer[slot, : payload.numel()]
        view.copy_(payload)
        return view

    def issued(self, index: int, done: CopyDone | None) -> None:
        """Caller side, for every chunk in order: chunk ``index`` is handled; ``done``
        marks the end of its copy out of its slot (None: its slot was not used)."""
        with self._cond:
            if index != self._issued:
                raise RuntimeError(f"chunk {index} handled out of order (expected {self._issued})")
            if done is not None:
                self._done[index % self.slots] = done
            self._issued = index + 1
            self._cond.notify_all()

    def close(self) -> None:
        """End the get: workers still waiting for a slot give up (:class:`RingClosed`)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def release(self) -> None:
        """After :meth:`close`, once every worker of the get returned: free the ring."""
        self._busy.release()
