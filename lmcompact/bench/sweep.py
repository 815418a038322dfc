"""A budget sweep of the connector's release group: plain vLLM once, then one run per budget.

Shared by ``lmcompact bench capacity`` and ``lmcompact bench serve``: the ``--budgets``
parser, the run plans (baseline + one in-place pack per budget), running each plan in its
own process (:func:`lmcompact.bench.child.run_child`), the command line recorded in the
JSON, and writing the JSON and the plot.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcompact.bench.child import run_child
from lmcompact.results import write_json

Plan = tuple[str, dict[str, Any] | None]
"""(run name, ``kv_connector_extra_config`` or None for plain vLLM)."""


def parse_budgets(text: str) -> list[str]:
    """``--budgets`` ("0.25,0.5") as strings, each a ratio in (0, 1); ValueError otherwise."""
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    if not budgets:
        raise ValueError("--budgets needs at least one value")
    for b in budgets:
        try:
            ok = 0.0 < float(b) < 1.0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--budgets values must be in (0, 1), got {b}")
    return budgets


def budget_plans(
    policy: str,
    budgets: list[str],
    window: int,
    memory: dict[str, Any],
    options: dict[str, Any] | None = None,
) -> list[Plan]:
    """The baseline, then per budget ``policy`` packed in place (no store); ``options``
    are further connector options (e.g. ``cuda_graphs``)."""
    plans: list[Plan] = [("baseline", None)]
    for b in budgets:
        extra = {
            "policy": policy,
            "budget": float(b),
            "window": window,
            "store": False,
            "release": memory,
            **(options or {}),
        }
        plans.append((b, extra))
    return plans


def run_plans(
    bench: str,
    workload: dict[str, Any],
    plans: list[Plan],
    scratch: Path | None = None,
    on_result: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each plan in its own ``lmcompact bench <bench> --child`` process; results by name.

    ``scratch`` holds the specs and results (default: a temporary folder removed after);
    ``on_result(name, result)`` runs after each plan.
    """
    if scratch is None:
        with tempfile.TemporaryDirectory(prefix=f"lmc-{bench}-") as folder:
            return run_plans(bench, workload, plans, Path(folder), on_result)
    runs: dict[str, dict[str, Any]] = {}
    for name, extra in plans:
        print(f"{bench}: running {name} ...", file=sys.stderr, flush=True)
        runs[name] = run_child(bench, workload, extra, scratch, name.replace(".", "_"))
        if on_result is not None:
            on_result(name, runs[name])
    return runs


def bench_command(bench: str) -> str:
    """``lmcompact bench <bench> <its arguments>`` as this process was started."""
    args = sys.argv[3:] if sys.argv[1:3] == ["bench", bench] else sys.argv[1:]
    return f"lmcompact bench {bench} " + " ".join(args)


def publish(
    args: argparse.Namespace,
    payload: dict[str, Any],
    plot: Callable[[Path], None],
) -> None:
    """Write ``payload`` to ``--json`` and, with a JSON file or ``--plot``, draw the plot
    (next to the JSON as ``.png`` unless ``--plot`` names a path)."""
    write_json(args.json, payload)
    if args.json not in (None, "-") or args.plot:
        plot(Path(args.plot) if args.plot else Path(args.json).with_suffix(".png"))
