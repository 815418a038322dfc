"""Summaries, a table and plots of ``lmcompact eval --engine vllm`` rows.

kvpress rows (``engine: "kvpress"``, from ``--compare kvpress`` or ``--engine kvpress``)
are summarized beside ours: their policy reads ``snapkv [kvpress]``, their full cache
``full cache [kvpress]``, and :mod:`lmcompact.eval.kvpress_compare` adds the side-by-side
table on the questions both answered."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcompact.eval.tables import fmt, group_by, table_head

KEY = ("engine", "model", "task", "context", "compact_on", "policy", "budget")
MODE_ORDER = {"none": 0, "default": 1, "save": 2, "load": 3, "both": 4, "inplace": 5}


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per :data:`KEY`: mean ``accuracy`` over ``n`` questions, the cell's wall
    time ``cell_s``, mean seconds per question, and ``store_ok`` (every question hit the
    chunks it should, and every compacting question request was packed or loaded a hole);
    for stored modes ``stored_vs_bf16`` (the store's bytes over the context's full KV in
    bf16) and for packing modes and compacted loads ``gpu_held`` (the question request's
    blocks kept on the GPU after its pack or load, over its prompt's full blocks). Refused
    cells keep their ``error``."""
    out = []
    for key, members in group_by(rows, KEY).items():
        summary: dict[str, Any] = dict(zip(KEY, key, strict=True))
        errors = [m["error"] for m in members if m.get("error")]
        scored = [m for m in members if "accuracy" in m]
        summary["n"] = len(scored)
        summary["accuracy"] = statistics.fmean(m["accuracy"] for m in scored) if scored else None
        if key[0] == "kvpress":  # no engine cell: the sum of its questions' times
            summary["cell_s"] = sum(m.get("seconds", 0.0) for m in scored) if scored else None
        else:
            summary["cell_s"] = members[0].get("cell_s")
        summary["seconds"] = statistics.fmean(m["seconds"] for m in scored) if scored else None
        summary["store_ok"] = all(_honest(m) for m in scored) if scored else None
        stored = [
            m["bytes_stored"] / m["bytes_full_bf16"] for m in scored if m.get("bytes_full_bf16")
        ]
        summary["stored_vs_bf16"] = statistics.fmean(stored) if stored else None
        held = [
            1 - m["blocks_released"] / m["prompt_blocks"]
            for m in scored
            if (m.get("packs") or m.get("holes_adopted")) and m.get("prompt_blocks")
        ]
        summary["gpu_held"] = statistics.fmean(held) if held else None
        if errors:
            summary["error"] = errors[0]
        out.append(summary)
    return sorted(
        out,
        key=lambda r: (
            str(r["model"]),
            str(r["task"]),
            r["context"],
            MODE_ORDER.get(r["compact_on"], 9),
            r["policy"],
            -r["budget"],
        ),
    )


def _honest(row: dict[str, Any]) -> bool:
    """The question's request did what its mode says: hits as expected, and compacted."""
    mode = row["compact_on"]
    if row.get("engine", "vllm") != "vllm":
        return True  # kvpress rows: no store, nothing to check
    if row.get("hit_chunks", 0) != row.get("expected_hit_chunks", 0):
        return False
    if mode == "default":  # packed at load, or (sliding-window models) stored compacted
        packed = row.get("packs", 0) == 1 and row.get("blocks_released", 0) > 0
        full = row.get("bytes_full") or 0
        return packed or row.get("holes_adopted", 0) == 1 or 0 < row.get("bytes_stored", 0) < full
    if mode in ("load", "both", "inplace"):
        return row.get("packs", 0) == 1 and row.get("blocks_released", 0) > 0
    if mode == "save":
        return row.get("holes_adopted", 0) == 1
    return True


def _memory_table(rows: Sequence[dict[str, Any]], budgets: Sequence[float]) -> str | None:
    """Bytes in the store over the full bf16 KV, and blocks held on the GPU after the
    question's pack over its prompt's blocks, per (mode, policy) and budget."""
    lines = []
    for r in rows:
        if r.get("stored_vs_bf16") is None and r.get("gpu_held") is None:
            continue
        lines.append((r["compact_on"], r["policy"], r["budget"], r))
    if not lines:
        return None
    head = table_head(
        "store bytes / full bf16 KV, and GPU blocks held / prompt blocks",
        ["compact_on", "policy", *[f"b={b:g}" for b in budgets]],
    )
    pairs = sorted({(m, p) for m, p, _, _ in lines}, key=lambda q: (MODE_ORDER.get(q[0], 9), q[1]))
    for mode, policy in pairs:
        cells = {b: r for m, p, b, r in lines if (m, p) == (mode, policy)}
        values = []
        for b in budgets:
            cell = cells.get(b)
            values.append(
                ""
                if cell is None
                else f"{fmt(cell.get('stored_vs_bf16'))} / {fmt(cell.get('gpu_held'))}"
            )
        head.append(f"| {mode} | {policy} | " + " | ".join(values) + " |")
    return "\n".join(head)


def _label(row: dict[str, Any]) -> str:
    """The policy as the tables and plots show it: kvpress's rows say so."""
    engine = row.get("engine", "vllm")
    return row["policy"] if engine == "vllm" else f"{row['policy']} [{engine}]"


def markdown(
    summary: Sequence[dict[str, Any]], samples: Sequence[dict[str, Any]] | None = None
) -> str:
    """One table per (model, task, context): rows (mode, policy), columns budgets; with
    the raw rows (``samples``) and kvpress among them, the side-by-side tables of
    :func:`lmcompact.eval.kvpress_compare.side_by_side` follow."""
    from lmcompact.eval import kvpress_compare

    summary = [{**r, "policy": _label(r)} for r in summary]
    sections = []
    blocks = sorted({(r["model"], r["task"], r["context"]) for r in summary if r["task"]})
    for model, task, context in blocks:
        rows = [
            r for r in summary if (r["model"], r["task"], r["context"]) == (model, task, context)
        ]
        budgets = sorted({r["budget"] for r in rows if r["compact_on"] != "none"}, reverse=True)
        header = ["compact_on", "policy", *[f"b={b:g}" for b in budgets], "n", "cell s"]
        title = f"{model}, {task}, context {context} (accuracy; n questions per cell)"
        lines = table_head(title, header)
        for r in rows:
            if r["compact_on"] == "none":
                acc = fmt(r["accuracy"])
                name = "full cache" + ("" if r.get("engine", "vllm") == "vllm" else " [kvpress]")
                lines.append(
                    f"| {name} | none | "
                    + "".join(f"{acc} | " for _ in budgets)
                    + f"{r['n']} | {fmt(r['cell_s'])} |"
                )
        pairs = sorted(
            {(r["compact_on"], r["policy"]) for r in rows if r["compact_on"] != "none"},
            key=lambda p: (MODE_ORDER.get(p[0], 9), p[1]),
        )
        for mode, policy in pairs:
            cells = {
                r["budget"]: r for r in rows if (r["compact_on"], r["policy"]) == (mode, policy)
            }
            values = []
            for b in budgets:
                cell = cells.get(b)
                if cell is None:
                    values.append("")
                elif cell.get("error"):
                    values.append("refused")
                else:
                    flag = "" if cell["store_ok"] else " (!)"
                    values.append(fmt(cell["accuracy"]) + flag)
            n = max((c["n"] for c in cells.values()), default=0)
            wall = [c["cell_s"] for c in cells.values() if c.get("cell_s") is not None]
            lines.append(
                f"| {mode} | {policy} | "
                + " | ".join(values)
                + f" | {n} | {fmt(statistics.fmean(wall)) if wall else ''} |"
            )
        sections.append("\n".join(lines))
        memory = _memory_table(rows, budgets)
        if memory:
            sections.append(memory)
    refused = [r for r in summary if r.get("error")]
    if refused:
        lines = ["### refused configurations", ""]
        for r in refused:
            lines.append(
                f"- {r['model']} {r['compact_on']} {r['policy']} {r['budget']:g}: {r['error']}"
            )
        sections.append("\n".join(lines))
    compared = kvpress_compare.markdown(kvpress_compare.side_by_side(samples or []))
    if compared:
        sections.append(compared)
    note = (
        "(!) = a question's request missed the store or was not compacted; cell s = wall "
        "time of the engine cell (every task of that context length, engine start included)"
    )
    return "\n\n".join([*sections, note]) + "\n"


def plot(summary: Sequence[dict[str, Any]], out_dir: str | Path, prefix: str) -> list[Path]:
    """One PNG per task: accuracy vs budget per policy, one panel per (model, context) row
    and mode column; the full cache is a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    summary = [{**r, "policy": _label(r)} for r in summary]
    for task in sorted({r["task"] for r in summary if r["task"]}):
        rows = [r for r in summary if r["task"] == task and not r.get("error")]
        panels = sorted({(r["model"], r["context"]) for r in rows})
        modes = sorted(
            {r["compact_on"] for r in rows if r["compact_on"] != "none"},
            key=lambda m: MODE_ORDER.get(m, 9),
        )
        if not panels or not modes:
            continue
        names = sorted({r["policy"] for r in rows if r["compact_on"] != "none"})
        cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        color = {name: cycle[i % len(cycle)] for i, name in enumerate(names)}
        fig, axes = plt.subplots(
            len(panels),
            len(modes),
            figsize=(4.2 * len(modes), 3.4 * len(panels)),
            squeeze=False,
            sharey=True,
        )
        for i, (model, context) in enumerate(panels):
            here = [r for r in rows if (r["model"], r["context"]) == (model, context)]
            full = [r for r in here if r["compact_on"] == "none"]
            for j, mode in enumerate(modes):
                ax = axes[i][j]
                for r in full:
                    ax.axhline(
                        r["accuracy"],
                        color="black" if r.get("engine", "vllm") == "vllm" else "grey",
                        linestyle=":",
                        label="full cache"
                        + ("" if r.get("engine", "vllm") == "vllm" else " [kvpress]"),
                    )
                for policy in sorted({r["policy"] for r in here if r["compact_on"] == mode}):
                    line = sorted(
                        (r for r in here if (r["compact_on"], r["policy"]) == (mode, policy)),
                        key=lambda r: r["budget"],
                    )
                    ax.plot(
                        [r["budget"] for r in line],
                        [r["accuracy"] for r in line],
                        marker="o",
                        color=color[policy],
                        linestyle="--" if policy.endswith("[kvpress]") else "-",
                        label=policy,
                    )
                ax.set_xscale("log")
                budgets = sorted({r["budget"] for r in here if r["compact_on"] == mode})
                ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
                ax.minorticks_off()
                ax.set_ylim(-0.05, 1.05)
                ax.set_title(f"{model} {context} compact_on={mode}", fontsize=9)
                ax.set_xlabel("budget (kept fraction)")
                if j == 0:
                    ax.set_ylabel(f"{task} accuracy")
                ax.legend(fontsize=6)
        fig.tight_layout()
        path = out_dir / f"{prefix}_{task}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


ROW_ID = (*KEY, "seed", "sample", "question", "depth")
"""One question of one cell: ``needle`` rows of a sample share ``question`` 0 (one context
per depth), so the depth tells them apart; runs with another ``--seed`` ask other contexts."""


def merge(payloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One payload from several runs' JSON (or earlier merges): their rows (a row already
    present, e.g. the same full-cache baseline in two runs, is kept once), summary and
    commands. A run's rows get its config's ``seed`` (0 when absent); the rows of every seed
    count together in a cell."""
    seen: set[tuple[Any, ...]] = set()
    rows: list[dict[str, Any]] = []
    for payload in payloads:
        seed = (payload.get("config") or {}).get("seed", 0)
        for row in payload["samples"]:
            row = {"seed": seed, **row}
            key = tuple(row.get(k) for k in ROW_ID)
            if key in seen and row.get("task") is not None:
                continue
            seen.add(key)
            rows.append(row)
    # an input may itself be a merged payload (``commands`` / ``configs`` lists)
    commands = [c for p in payloads for c in p.get("commands", [p.get("command")])]
    configs = [c for p in payloads for c in p.get("configs", [p.get("config")])]
    return {
        "commands": commands,
        "engine": "vllm",
        "configs": configs,
        "elapsed_s": sum(p.get("elapsed_s", 0.0) for p in payloads),
        "results": summarize(rows),
        "samples": rows,
    }


def relabel(payload: dict[str, Any], renames: dict[str, str]) -> list[str]:
    """Rename the ``policy`` of our (``engine`` ``"vllm"``) rows in place, old -> new label,
    exact matches only, and return a note per rename that took effect.

    When a default changes, earlier rows that ran with the old default keep their meaning
    under an explicit label (``snapkv`` -> ``snapkv(kernel_size=7)``), so a merge neither
    mixes them with runs of the new default nor drops one as a duplicate of the other."""
    notes = []
    for old, new in renames.items():
        count = 0
        for row in payload["samples"]:
            if row.get("engine", "vllm") == "vllm" and row.get("policy") == old:
                row["policy"] = new
                count += 1
        if count:
            notes.append(f"relabelled {count} rows: {old} -> {new}")
    return notes


def split_relabel(item: str) -> tuple[str, str]:
    """``OLD=NEW`` at the first ``=`` outside parentheses (labels hold ``name(key=value)``);
    ``("", "")`` when there is none."""
    depth = 0
    for index, char in enumerate(item):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "=" and depth == 0:
            return item[:index], item[index + 1 :]
    return "", ""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lmcompact.eval.vllm_report --json OUT IN.json ...``: merge runs, write the
    JSON, the markdown table and the plots next to it. ``--relabel OLD=NEW`` renames our rows'
    policy label in the inputs first (:func:`relabel`; recorded in the output's
    ``relabelled``)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("inputs", nargs="+", help="JSON files of lmcompact eval --engine vllm")
    parser.add_argument("--json", required=True, help="merged JSON to write")
    parser.add_argument(
        "--relabel",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="rename a policy label of our rows in the inputs before merging (repeatable)",
    )
    args = parser.parse_args(argv)
    renames = {}
    for item in args.relabel:
        old, new = split_relabel(item)
        if not old or not new:
            parser.error(f"--relabel takes OLD=NEW, got {item!r}")
        renames[old] = new
    inputs = [json.loads(Path(p).read_text()) for p in args.inputs]
    notes = [n for payload in inputs for n in relabel(payload, renames)]
    payload = merge(inputs)
    previous = [n for p in inputs for n in p.get("relabelled", [])]
    if previous or notes:
        payload["relabelled"] = previous + notes
    out = Path(args.json)
    out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    table = markdown(payload["results"], payload["samples"])
    out.with_suffix(".md").write_text(table)
    plot(payload["results"], out.parent, out.stem)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
