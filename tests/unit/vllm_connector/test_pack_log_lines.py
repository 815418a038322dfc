"""Every in-place pack logs one INFO line, on the reference path and on the device path.

The device path needs CUDA (Triton kernels); both paths end in ``Worker._done``, which
writes the line, so it is checked here on a worker-shaped stand-in with caplog.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from connectors.vllm import metadata as wire
from connectors.vllm.worker import Worker


def _worker_state() -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(policy="snapkv"),
        forget_window=lambda req_id: None,
        _lock=threading.Lock(),
        _report=wire.WorkerReport(),
        tp_rank=0,
        pack_stats={"packs": 0, "tokens": 0, "seconds": 0.0},
    )


@pytest.mark.parametrize("on_device", [False, True])
def test_every_pack_path_logs_its_line(on_device: bool, caplog: pytest.LogCaptureFixture) -> None:
    state = _worker_state()
    job = wire.PackJob("req-1", [1, 2, 3, 4], num_tokens=128, kept=64, reserved=64)
    timings = None if on_device else {"score_s": 0.004, "plan_s": 0.005, "plans": 3.0}
    with caplog.at_level(logging.INFO, logger="connectors.vllm.worker"):
        Worker._done(state, job, 0.01, on_device=on_device, timings=timings)  # type: ignore[arg-type]
    where = (
        " on the device, launched in 0.010 s"
        if on_device
        else " in 0.010 s (scores 0.004 s, plans 0.005 s over 3 asks)"
    )
    expected = f"compacted req-1 in place{where}: kept 64 of 128 prompt tokens per (layer, head)"
    assert [r.getMessage() for r in caplog.records] == [f"{expected} (snapkv)"]
    assert state._report.packed == {("req-1", 0)} and state.pack_stats["packs"] == 1
