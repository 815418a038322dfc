"""One JSON line per engine step, for latency analysis (the ``step_trace`` option).

The scheduler half writes, when it plans a step, what the step holds: its prefill tokens,
its decode rows, and the connector's work in it (loads, packs, saves). Each worker writes
the packs it ran, with the step they belong to and their GPU time (CUDA events read once
they completed, never waited for on the forward path). Times are ``time.perf_counter()``,
the machine's monotonic clock, which a client such as ``vllm bench serve`` on the same
machine also stamps its requests with; ``lmcompact bench itl`` joins the three.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


class StepTrace:
    """A JSON-lines file, line-buffered so a server stopped by a signal keeps its lines."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def worker_trace_path(path: str, rank: int) -> str:
    """The file one tensor-parallel rank writes its packs to, beside the scheduler's."""
    return f"{path}.rank{rank}"


@dataclass
class _PendingPack:
    step: int
    req_id: str
    began: float
    host_s: float
    start: Any  # torch.cuda.Event, or None for a pack that ran on the host
    end: Any


class PackTrace:
    """The packs of one worker, written once their GPU time is known."""

    def __init__(self, path: str) -> None:
        self._trace = StepTrace(path)
        self._pending: list[_PendingPack] = []

    def add(
        self, step: int, req_id: str, began: float, host_s: float, start: Any, end: Any
    ) -> None:
        """A pack of ``step`` began at ``began`` (perf_counter) and took ``host_s`` on the
        host; ``start``/``end`` are its CUDA events (None on the host path)."""
        self._pending.append(_PendingPack(step, req_id, began, host_s, start, end))

    def flush(self, wait: bool = False) -> None:
        """Write the packs whose events completed (all of them with ``wait``)."""
        left: list[_PendingPack] = []
        for pack in self._pending:
            if pack.end is not None and not wait and not pack.end.query():
                left.append(pack)
                continue
            gpu_ms = None
            if pack.end is not None:
                pack.end.synchronize()
                gpu_ms = float(pack.start.elapsed_time(pack.end))
            self._trace.write(
                {
                    "kind": "pack",
                    "step": pack.step,
                    "req": pack.req_id,
                    "t": pack.began,
                    "host_ms": 1e3 * pack.host_s,
                    "gpu_ms": gpu_ms if gpu_ms is not None else 1e3 * pack.host_s,
                }
            )
        self._pending = left

    def close(self) -> None:
        self.flush(wait=True)
        self._trace.close()


def step_record(
    step: int,
    prefill_tokens: int,
    prefill_rows: int,
    decode_rows: int,
    loads: int,
    load_tokens: int,
    packs: int,
    saves: int,
) -> dict[str, Any]:
    """The scheduler's line for one planned step."""
    return {
        "kind": "step",
        "step": step,
        "t": time.perf_counter(),
        "prefill_tokens": prefill_tokens,
        "prefill_rows": prefill_rows,
        "decode_rows": decode_rows,
        "loads": loads,
        "load_tokens": load_tokens,
        "packs": packs,
        "saves": saves,
    }
