"""StagingRing: the order that lets worker threads refill page-locked slots safely.

On the CPU the slots are ordinary memory and the "copy to the GPU" is a clone whose end
is marked by a stand-in for a CUDA event (it records when the caller marked it done); the
real ring (page-locked, CUDA events) runs in ``tests/gpu/test_store_quant.py``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lmcompact.store.tiers.staging import RingClosed, StagingRing


class Done:
    """Marks a copy out of a slot finished; counts the workers that waited on it."""

    def __init__(self) -> None:
        self.waits = 0
        self._lock = threading.Lock()

    def synchronize(self) -> None:
        with self._lock:
            self.waits += 1


def payloads(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 256, (100 + 17 * i,), generator=gen, dtype=torch.uint8) for i in range(n)
    ]


@pytest.mark.parametrize("workers", [1, 3, 6])
def test_workers_refill_a_slot_only_after_its_previous_copy_was_handled(workers: int) -> None:
    ring = StagingRing(512, 3, pin_memory=False)
    sources = payloads(11)
    assert ring.begin()
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(ring.stage, i, p) for i, p in enumerate(sources)]
        dones = []
        for i, future in enumerate(futures):
            view = future.result()
            # the slot still holds chunk i: no later chunk overwrote it before issued()
            assert (
                torch.equal(view, sources[i]) and view.data_ptr() == ring.buffer[i % 3].data_ptr()
            )
            dones.append(Done())
            ring.issued(i, dones[-1])
    ring.close()
    ring.release()
    # chunks 3.. waited for the copy of chunk i - 3 out of their slot
    assert [d.waits for d in dones] == [1] * 8 + [0] * 3


def test_a_closed_get_frees_waiting_workers_and_the_ring() -> None:
    ring = StagingRing(512, 2, pin_memory=False)
    sources = payloads(4)
    assert ring.begin() and not ring.begin()  # one get at a time
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(ring.stage, 0, sources[0])
        waiting = pool.submit(ring.stage, 2, sources[2])  # needs chunk 0 handled first
        assert first.result() is not None and not waiting.done()
        ring.close()  # the caller stopped (an error) before handling chunk 0
        with pytest.raises(RingClosed):
            waiting.result()
    ring.release()
    assert ring.begin()  # free for the next get, counting from chunk 0 again
    view = ring.stage(0, sources[1])
    assert torch.equal(view, sources[1])
    ring.issued(0, None)
    with pytest.raises(RuntimeError, match="out of order"):
        ring.issued(2, None)
    with pytest.raises(ValueError, match="do not fit"):
        ring.stage(1, torch.zeros(513, dtype=torch.uint8))
    ring.close()
    ring.release()
