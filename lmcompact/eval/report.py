"""Aggregate per-sample rows, render a markdown table, draw score-vs-budget plots."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcompact.eval.tables import fmt, group_by, table_head, table_row

KEY = ("impl", "task", "policy", "budget", "context")
MEANS = (
    "accuracy",
    "ppl",
    "ppl_full",
    "kept_ratio",
    "cache_bytes",
    "full_bytes",
    "compaction_s",
    "scores_s",
    "select_s",
    "decode_compaction_s",
    "generate_s",
    "forward_s",
)


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean of every numeric field over samples, one row per (impl, task, policy, budget,
    context); ``samples`` counts them and ``exact`` says whether every agreement was 1.0."""
    out = []
    for key, members in group_by(rows, KEY).items():
        summary: dict[str, Any] = dict(zip(KEY, key, strict=True))
        summary["samples"] = len(members)
        for name in MEANS:
            values = [m[name] for m in members if m.get(name) is not None]
            summary[name] = statistics.fmean(values) if values else None
        if summary["task"] == "agreement":
            summary["exact"] = all(m["accuracy"] == 1.0 for m in members)
            divergences = [
                m["first_divergence"] for m in members if m["first_divergence"] is not None
            ]
            summary["first_divergence_min"] = min(divergences) if divergences else None
        out.append(summary)
    order = {"full": -1}
    return sorted(
        out,
        key=lambda r: (
            r["task"],
            r["context"],
            order.get(r["policy"], 0),
            r["policy"],
            r["impl"],
            -r["budget"],
        ),
    )


def markdown(summary: Sequence[dict[str, Any]]) -> str:
    """One markdown table per task: rows (policy, impl), columns budget, per context."""
    sections = []
    for task in ("needle", "agreement", "ppl"):
        rows = [r for r in summary if r["task"] == task]
        if not rows:
            continue
        metric = "ppl" if task == "ppl" else "accuracy"
        budgets = sorted({r["budget"] for r in rows}, reverse=True)
        contexts = sorted({r["context"] for r in rows})
        header = [
            "context",
            "policy",
            "impl",
            *[f"b={b:g}" for b in budgets],
            "kept@min",
            "compaction s",
        ]
        lines = table_head(f"{task} ({metric}, mean over samples)", header)
        for context in contexts:
            keys = sorted(
                {(r["policy"], r["impl"]) for r in rows if r["context"] == context},
                key=lambda k: (k[0] != "full", k[0], k[1]),
            )
            for policy, impl in keys:
                cells = {
                    r["budget"]: r
                    for r in rows
                    if (r["context"], r["policy"], r["impl"]) == (context, policy, impl)
                }
                values = [fmt(cells[b][metric]) if b in cells else "" for b in budgets]
                smallest = cells[min(cells)]
                kept, seconds = smallest.get("kept_ratio"), smallest.get("compaction_s")
                lines.append(
                    table_row([str(context), policy, impl, *values, fmt(kept), fmt(seconds)])
                )
        sections.append("\n".join(lines))
    timing = _timing_table(summary)
    if timing:
        sections.append(timing)
    return "\n\n".join(sections) + "\n"


def _timing_table(summary: Sequence[dict[str, Any]]) -> str:
    """Compaction seconds per (context, policy, impl) and budget, from the needle prompts."""
    rows = [
        r
        for r in summary
        if r["task"] == "needle" and r["policy"] != "full" and r.get("compaction_s") is not None
    ]
    if not rows:
        return ""
    budgets = sorted({r["budget"] for r in rows}, reverse=True)
    header = ["context", "policy", "impl", *[f"b={b:g}" for b in budgets]]
    lines = table_head("compaction time (s, needle prompt, mean over samples)", header)
    cells = {(r["context"], r["policy"], r["impl"], r["budget"]): r for r in rows}
    for context, policy, impl in sorted({(r["context"], r["policy"], r["impl"]) for r in rows}):
        values = [
            fmt(cells[(context, policy, impl, b)]["compaction_s"])
            if (context, policy, impl, b) in cells
            else ""
            for b in budgets
        ]
        lines.append(table_row([str(context), policy, impl, *values]))
    return "\n".join(lines)


def plot(
    summary: Sequence[dict[str, Any]], out_dir: str | Path, prefix: str = "eval"
) -> list[Path]:
    """PNG per (task, context): score vs budget, one line per (policy, impl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in ("needle", "agreement", "ppl"):
        for context in sorted({r["context"] for r in summary if r["task"] == task}):
            rows = [r for r in summary if r["task"] == task and r["context"] == context]
            metric = "ppl" if task == "ppl" else "accuracy"
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for policy, impl in sorted({(r["policy"], r["impl"]) for r in rows}):
                line = sorted(
                    (r for r in rows if (r["policy"], r["impl"]) == (policy, impl)),
                    key=lambda r: r["budget"],
                )
                if policy == "full":
                    ax.axhline(line[0][metric], color="black", linestyle=":", label="full cache")
                    continue
                style = "--" if impl == "kvpress" else "-"
                ax.plot(
                    [r["budget"] for r in line],
                    [r[metric] for r in line],
                    style,
                    marker="o",
                    label=f"{policy} ({impl})",
                )
            ax.set_xscale("log")
            ax.set_xlabel("budget (kept fraction)")
            ax.set_ylabel(metric)
            if task == "ppl":
                ax.set_yscale("log")
            ax.set_title(f"{task}, context {context}")
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            path = out_dir / f"{prefix}_{task}_{context}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths
