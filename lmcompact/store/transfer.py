"""Chunk copies between a CUDA device and host memory on a side stream.

Saving a device chunk into a (pinned) host buffer, or loading a host chunk into a device
buffer, is queued on a side :class:`torch.cuda.Stream` of the device with ``non_blocking``
copies, after the work already queued on the producer's stream (the side stream waits on
it). The caller's stream, the one running the forward pass, never waits for the copy; an
event recorded after the copies is what a reader waits on before it touches the bytes::

    current stream  ──[forward writes K/V]──┬──[forward goes on] ...
                                            │ wait_stream
    side stream                             └──[copies, non_blocking]──● event
    host reader (pinned destination)                                   └─ event.synchronize()
    device reader (device destination)         current stream.wait_event(event) ─┘

Page-locked host memory is what makes the host side of the copy asynchronous (the CPU tier
pins its buffers when CUDA is present); with pageable memory CUDA copies synchronously and
the result is the same. Nothing here runs without CUDA: :func:`needs_stream_copy` is False
for two CPU tensors, and the memory tiers then copy exactly as before.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmcompact.store.chunk import CompactedChunk, packed_span, unpack_views
from lmcompact.store.pinned_pool import PinnedBufferPool


def needs_stream_copy(source: torch.device, destination: torch.device) -> bool:
    """Whether a copy between these devices crosses host and CUDA (one side each)."""
    kinds = {source.type, destination.type}
    return kinds == {"cpu", "cuda"}


@dataclass
class PendingCopy:
    """A copy queued on a side stream; readers call :meth:`wait` before using the result.

    Attributes:
        event: recorded on the side stream after the copies.
        destination: device of the copy's destination.
        sources: what the copy reads, kept alive (and so not recycled by a tier, nor
            handed back to the caching allocator) until the copy finished.
    """

    event: torch.cuda.Event
    destination: torch.device
    sources: tuple[torch.Tensor, ...] = field(default_factory=tuple)

    def done(self) -> bool:
        """True once the copy finished (never blocks); then the sources are released."""
        if self.event.query():
            self.sources = ()
            return True
        return False

    def wait(self) -> None:
        """Make the destination safe to read for the caller.

        A host destination blocks the calling thread until the copy finished. A device
        destination only makes the caller's current stream wait for it (no host stall);
        work queued on that stream afterwards sees the copied bytes.
        """
        if self.destination.type == "cuda":
            torch.cuda.current_stream(self.destination).wait_event(self.event)
            self.done()
        else:
            self.event.synchronize()
            self.sources = ()

    def synchronize(self) -> None:
        """Block the calling thread until the copy finished (before reusing its memory)."""
        self.event.synchronize()
        self.sources = ()


class StreamCopier:
    """Copies chunks between one CUDA device and host memory on a side stream of it.

    Args:
        device: the CUDA device whose side stream carries the copies.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"StreamCopier needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)

    def pack_into(
        self, chunk: CompactedChunk, buffer: torch.Tensor
    ) -> tuple[CompactedChunk, PendingCopy]:
        """Queue ``chunk``'s bytes into ``buffer`` (packed layout; one side on this device,
        the other on the host).

        Args:
            chunk: the source, on this device or on the host.
            buffer: uint8 ``(chunk.payload_nbytes,)`` destination on the other side.

        Returns:
            The chunk viewing ``buffer`` (not readable before the pending copy's
            :meth:`PendingCopy.wait`) and the pending copy.
        """
        stored, pending = self.pack_many([chunk], [buffer])
        return stored[0], pending

    def pack_many(
        self, chunks: Sequence[CompactedChunk], buffers: Sequence[torch.Tensor]
    ) -> tuple[list[CompactedChunk], PendingCopy]:
        """:meth:`pack_into` for a batch: one stream hand-off and one event for all copies
        (the per-copy fixed cost, not the bytes, bounds a batch of small chunks).

        Raises:
            ValueError: a pair that does not cross host and CUDA, or buffers on more than
                one device.
        """
        if len({b.device for b in buffers}) > 1 or len(chunks) != len(buffers):
            raise ValueError("pack_many needs one buffer per chunk, all on one device")
        for chunk, buffer in zip(chunks, buffers, strict=True):
            if not needs_stream_copy(chunk.device, buffer.device):
                raise ValueError(
                    "a stream copy goes between host and CUDA, "
                    f"got {chunk.device} -> {buffer.device}"
                )
        stored: list[CompactedChunk] = []
        sources: list[torch.Tensor] = []
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for chunk, buffer in zip(chunks, buffers, strict=True):
                stored.append(self._queue_pack(chunk, buffer))
                sources += (chunk.positions, chunk.keys, chunk.values)
            event = torch.cuda.Event()
            event.record(self.stream)
        return stored, PendingCopy(event, buffers[0].device, tuple(sources))

    def _queue_pack(self, chunk: CompactedChunk, buffer: torch.Tensor) -> CompactedChunk:
        """Queue one chunk's copy on the side stream (the caller made it current)."""
        dst = unpack_views(
            buffer, chunk.total_kept, chunk.keys.shape[1], chunk.values.shape[1], chunk.dtype
        )
        src = (chunk.positions, chunk.keys, chunk.values)
        span = packed_span(chunk)
        if span is not None:  # one copy of the whole packed payload
            buffer.copy_(span, non_blocking=True)
        else:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=True)
        for t in (*src, buffer):
            if t.is_cuda:  # allocated on another stream, used on this one
                t.record_stream(self.stream)
        return CompactedChunk._trusted(dst[1], dst[2], chunk.kept_counts, dst[0], chunk.num_tokens)

    def to_host(
        self, tensors: Sequence[torch.Tensor], pool: PinnedBufferPool | None = None
    ) -> tuple[list[torch.Tensor], PendingCopy]:
        """Queue copies of tensors on this device into pinned host tensors.

        For a saver that must not hold up the forward pass (e.g. KV pages gathered on the
        device): the copies start after the work queued so far on the current stream; call
        :meth:`PendingCopy.wait` (host) before reading the returned tensors. The pinned
        buffers come from ``pool`` (reserved at start-up, see
        :class:`~lmcompact.store.pinned_pool.PinnedBufferPool`) or, without one, from
        torch's host allocator cache; a miss allocates page-locked memory, which CUDA makes
        synchronize the device. Drop the returned tensors when done so later saves reuse
        their buffers.

        Args:
            tensors: tensors on this device, any shapes and dtypes.
            pool: where the host buffers come from.

        Returns:
            Pinned host tensors of the same shapes and dtypes, and the pending copy.
        """
        out = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            if pool is None
            else pool.take(t.shape, t.dtype)
            for t in tensors
        ]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for o, t in zip(out, tensors, strict=True):
                if t.device != self.device:
                    raise ValueError(
                        f"to_host copies from {self.device}, got a tensor on {t.device}"
                    )
                o.copy_(t, non_blocking=True)
                t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, PendingCopy(event, torch.device("cpu"), tuple(tensors))

    def to_device(self, chunks: list[CompactedChunk]) -> tuple[list[CompactedChunk], PendingCopy]:
        """Load host chunks onto this device, each into one fresh packed buffer.

        Returns:
            The device chunks and one pending copy for all of them: call its
            :meth:`PendingCopy.wait` on the stream that will read them.
        """
        if not chunks:  # nothing to copy: an event that is already complete
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            return [], PendingCopy(event, self.device)
        buffers = [
            torch.empty(c.payload_nbytes, dtype=torch.uint8, device=self.device) for c in chunks
        ]
        return self.pack_many(chunks, buffers)


class CopierPool:
    """One lazily created :class:`StreamCopier` per CUDA device (thread-safe)."""

    def __init__(self) -> None:
        self._copiers: dict[torch.device, StreamCopier] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._copiers)

    def for_copy(self, source: torch.device, destination: torch.device) -> StreamCopier | None:
        """The copier for a host <-> CUDA copy, or None when the copy stays on one side."""
        if not needs_stream_copy(source, destination):
            return None
        device = source if source.type == "cuda" else destination
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            copier = self._copiers.get(device)
            if copier is None:
                copier = self._copiers[device] = StreamCopier(device)
            return copier
