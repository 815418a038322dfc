"""``lmcompact bench itl``: which engine steps make the tail inter-token latency.

Reads what ``vllm bench serve --save-detailed`` wrote for a server with the connector (each
request's start, time to first token and inter-token latencies) and the connector's
``step_trace`` of the same run (one line per engine step: prefill tokens, decode rows,
loads, packs; one line per pack with its GPU time), optionally the same benchmark against
vLLM alone. Both sides stamp ``time.perf_counter()``, the machine's monotonic clock, so each
gap between two tokens of a request is matched to the engine step that overlaps it most.

For the slowest 1% of the gaps (those that make the P99 inter-token latency) it reports the
cause of their step (``prefill chunk``: the step also computes prompt tokens of requests
being admitted; ``pack``: the step ends with an in-place pack; ``load``: it writes stored
chunks; ``decode only``), and the connector's share: the GPU time of the packs whose step
ends in the gap, in decode steps (the median duration of decode-only steps).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from lmcompact.results import format_table, write_json

NAME = "itl"
HELP = "P99 inter-token latency of a vllm bench serve run, broken down by engine step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--result", required=True, help="vllm bench serve --save-detailed JSON")
    parser.add_argument("--trace", required=True, help="the connector's step_trace file")
    parser.add_argument("--baseline", default=None, help="the same benchmark against vLLM alone")
    parser.add_argument("--percentile", type=float, default=99.0, help="tail percentile")
    parser.add_argument("--json", default=None, help="write results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG here")


def read_trace(path: str | Path) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """Steps in time order, and packs per step (from every rank's file beside ``path``)."""
    path = Path(path)
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = sorted((s for s in steps if s.get("kind") == "step"), key=lambda s: s["t"])
    packs: dict[int, list[dict[str, Any]]] = {}
    for rank_file in sorted(path.parent.glob(path.name + ".rank*")):
        for line in rank_file.read_text().splitlines():
            if line.strip():
                pack = json.loads(line)
                packs.setdefault(int(pack["step"]), []).append(pack)
    return steps, packs


def token_gaps(result: dict[str, Any]) -> list[tuple[float, float]]:
    """Every ``(previous token time, token time)`` of every request (perf_counter)."""
    gaps = []
    rows = zip(result["start_times"], result["ttfts"], result["itls"], strict=True)
    for start, ttft, itls in rows:
        if ttft is None:
            continue
        t = float(start) + float(ttft)
        for itl in itls:
            gaps.append((t, t + float(itl)))
            t += float(itl)
    return gaps


def cause(step: dict[str, Any], packs: list[dict[str, Any]]) -> str:
    parts = []
    if step.get("prefill_rows", 0):
        parts.append("prefill chunk")
    if step.get("loads", 0):
        parts.append("load")
    if packs:
        parts.append("pack")
    return " + ".join(parts) or "decode only"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def breakdown(
    result: dict[str, Any],
    steps: list[dict[str, Any]],
    packs: dict[int, list[dict[str, Any]]],
    q: float = 99.0,
) -> dict[str, Any]:
    """The tail gaps of ``result`` matched to ``steps`` (see the module docstring)."""
    if len(steps) < 2:
        raise ValueError("the step trace has fewer than two steps")
    starts = [s["t"] for s in steps]
    spans = [(starts[i], starts[i + 1]) for i in range(len(steps) - 1)]
    durations = [b - a for a, b in spans]
    pack_ms = {i: sum(p["gpu_ms"] for p in packs.get(s["step"], [])) for i, s in enumerate(steps)}
    decode_only = [
        durations[i]
        for i in range(len(spans))
        if cause(steps[i], packs.get(steps[i]["step"], [])) == "decode only"
        and steps[i].get("decode_rows", 0)
    ]
    if not decode_only:
        raise ValueError("no decode-only step in the trace")
    decode_step_ms = 1e3 * statistics.median(decode_only)
    gaps = token_gaps(result)
    itls_ms = [1e3 * (b - a) for a, b in gaps]
    threshold = percentile(itls_ms, q)
    tail = math.ceil((1 - q / 100) * len(gaps))  # the slowest gaps: the top (100 - q)%
    slowest = sorted(range(len(gaps)), key=lambda g: itls_ms[g], reverse=True)[:tail]
    causes: Counter[str] = Counter()
    shares: list[float] = []
    for a, b in (gaps[g] for g in slowest):
        first = max(0, bisect.bisect_right(starts, a) - 1)
        last = min(len(spans) - 1, bisect.bisect_left(starts, b))
        overlaps = [(min(b, spans[i][1]) - max(a, spans[i][0]), i) for i in range(first, last + 1)]
        overlap, behind = max(overlaps)
        if overlap <= 0:
            causes["no step (client side)"] += 1
            shares.append(0.0)
            continue
        causes[cause(steps[behind], packs.get(steps[behind]["step"], []))] += 1
        # a step's packs run after its forward pass: they are in the gap that holds its end
        shares.append(sum(pack_ms[i] for _, i in overlaps if a < spans[i][1] <= b))
    all_packs = [p["gpu_ms"] for group in packs.values() for p in group]
    prefill = [d for i, d in enumerate(durations) if steps[i].get("prefill_rows", 0)]
    return {
        "itl_count": len(itls_ms),
        "p50_itl_ms": percentile(itls_ms, 50),
        f"p{q:g}_itl_ms": threshold,
        "tail_gaps": sum(causes.values()),
        "tail_causes": dict(causes.most_common()),
        "decode_step_ms": decode_step_ms,
        "prefill_step_ms_median": 1e3 * statistics.median(prefill) if prefill else None,
        "steps": len(steps),
        "packs": len(all_packs),
        "pack_gpu_ms_p50": percentile(all_packs, 50) if all_packs else None,
        "pack_gpu_ms_max": max(all_packs) if all_packs else None,
        "connector_ms_in_tail_max": max(shares) if shares else 0.0,
        "connector_ms_in_tail_mean": statistics.fmean(shares) if shares else 0.0,
        "connector_share_steps": (max(shares) if shares else 0.0) / decode_step_ms,
    }


SERVE_KEYS = (
    "completed",
    "duration",
    "output_throughput",
    "mean_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
)


def serve_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of a ``vllm bench serve`` result."""
    row = {k: result.get(k) for k in SERVE_KEYS}
    if row["p99_itl_ms"] is None and "itls" in result:
        row["p99_itl_ms"] = percentile([1e3 * x for r in result["itls"] for x in r], 99)
    return row


def run(args: argparse.Namespace) -> int:
    result = json.loads(Path(args.result).read_text())
    steps, packs = read_trace(args.trace)
    figures = breakdown(result, steps, packs, args.percentile)
    rows = {"lmcompact": serve_summary(result)}
    if args.baseline:
        rows = {"vllm": serve_summary(json.loads(Path(args.baseline).read_text())), **rows}
    payload: dict[str, Any] = {"serve": rows, "breakdown": figures}
    if "vllm" in rows and rows["vllm"]["output_throughput"]:
        payload["output_throughput_ratio"] = (
            rows["lmcompact"]["output_throughput"] / rows["vllm"]["output_throughput"]
        )
    print(format_table([{"run": k, **v} for k, v in rows.items()]))
    print(format_table([{k: v for k, v in figures.items() if k != "tail_causes"}]))
    print("tail gaps by cause:", json.dumps(figures["tail_causes"]))
    write_json(args.json, payload)
    if args.plot:
        _plot(Path(args.plot), result, steps, packs, figures, args)
    return 0


def _plot(
    path: Path,
    result: dict[str, Any],
    steps: list[dict[str, Any]],
    packs: dict[int, list[dict[str, Any]]],
    figures: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    runs = {"lmcompact": result}
    if args.baseline:
        runs = {"vLLM alone": json.loads(Path(args.baseline).read_text()), **runs}
    for name, run_result in runs.items():
        itls = sorted(1e3 * x for r in run_result["itls"] for x in r)
        left.plot(itls, [(i + 1) / len(itls) for i in range(len(itls))], label=name)
    left.set_xscale("log")
    left.set_xlabel("inter-token latency (ms)")
    left.set_ylabel("fraction of tokens")
    left.axhline(args.percentile / 100, color="grey", lw=0.5)
    left.legend()
    left.set_title("inter-token latency, CDF")
    t0 = steps[0]["t"]
    colours = {"decode only": "tab:blue", "prefill chunk": "tab:orange", "pack": "tab:red"}
    for i in range(len(steps) - 1):
        kind = cause(steps[i], packs.get(steps[i]["step"], []))
        key = "pack" if "pack" in kind else "prefill chunk" if "prefill" in kind else "decode only"
        right.scatter(
            steps[i]["t"] - t0,
            1e3 * (steps[i + 1]["t"] - steps[i]["t"]),
            s=4,
            color=colours[key],
        )
    right.axhline(figures[f"p{args.percentile:g}_itl_ms"], color="grey", lw=0.5)
    right.set_yscale("log")
    right.set_xlabel("time (s)")
    right.set_ylabel("step duration (ms)")
    right.set_title("engine steps: blue decode only, orange + prefill, red + pack")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
