"""Our vLLM rows beside kvpress's on the same questions (``lmcompact eval --engine vllm``).

kvpress rows (``engine: "kvpress"``, :func:`lmcompact.eval.kvpress_bridge.run_kvpress_eval`)
answer the same token ids as the vLLM rows. Their ``compact_on`` names the setting:
``save`` (the context compressed without the question) is compared with our ``save``
rows, ``load`` (the question in the press's window) with our ``load`` and ``inplace``
rows, ``none`` (kvpress's full cache) with our full cache. A kvpress policy matches every
label of ours with the same method name (``kvzip+reconstruct(share=True)`` is ``kvzip``).
Accuracies are taken over the (sample, question) pairs that both sides answered, so runs
with different sample counts compare fairly.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from lmcompact.eval.tables import fmt, table_head

#: our ``compact_on`` values a kvpress setting is compared with
COUNTERPARTS = {"none": ("none",), "save": ("save",), "load": ("load", "inplace")}


def method(label: str) -> str:
    """The method of a row's policy label: ``kvzip+reconstruct(share=True)`` -> ``kvzip``."""
    return label.split("+")[0].split("(")[0]


def _answers(rows: Sequence[dict[str, Any]]) -> dict[tuple[Any, ...], float]:
    """Accuracy per question, identified as :data:`lmcompact.eval.vllm_report.ROW_ID` does
    (seed, sample, question, depth: another seed asks other contexts)."""
    return {
        (r.get("seed", 0), r["sample"], r["question"], r.get("depth")): r["accuracy"]
        for r in rows
        if "accuracy" in r
    }


def side_by_side(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (kvpress cell, matching cell of ours): ``model, task, context,
    compact_on`` (ours), ``kvpress_on``, ``policy`` (our label), ``budget``, ``n`` common
    questions, ``ours``, ``kvpress`` (mean accuracies over them) and ``ours_ge``."""
    cells: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("task") is None or "accuracy" not in r:
            continue
        key = (
            r.get("engine"),
            r["model"],
            r["task"],
            r["context"],
            r["compact_on"],
            r["policy"],
            r["budget"],
        )
        cells.setdefault(key, []).append(r)
    out = []
    for key, theirs in cells.items():
        engine, model, task, context, setting, policy, budget = key
        if engine != "kvpress":
            continue
        for ours_key, ours in cells.items():
            o_engine, o_model, o_task, o_context, o_mode, o_policy, o_budget = ours_key
            if (o_engine, o_model, o_task, o_context) != ("vllm", model, task, context):
                continue
            if o_mode not in COUNTERPARTS.get(setting, ()) or method(o_policy) != policy:
                continue
            if setting != "none" and o_budget != budget:
                continue
            mine, their = _answers(ours), _answers(theirs)
            common = sorted(set(mine) & set(their))
            if not common:
                continue
            ours_acc = statistics.fmean(mine[k] for k in common)
            kv_acc = statistics.fmean(their[k] for k in common)
            out.append(
                {
                    "model": model,
                    "task": task,
                    "context": context,
                    "compact_on": o_mode,
                    "kvpress_on": setting,
                    "policy": o_policy,
                    "press": theirs[0].get("press"),
                    "budget": budget,
                    "n": len(common),
                    "ours": ours_acc,
                    "kvpress": kv_acc,
                    "ours_ge": ours_acc >= kv_acc,
                }
            )
    order = {"none": 0, "save": 1, "load": 2, "inplace": 3}
    return sorted(
        out,
        key=lambda e: (
            e["model"],
            e["task"],
            e["context"],
            order.get(e["compact_on"], 9),
            method(e["policy"]),
            e["policy"],
            -e["budget"],
        ),
    )


def markdown(entries: Sequence[dict[str, Any]]) -> str:
    """A side-by-side table per (model, task, context); empty when there is nothing to pair."""
    sections = []
    for model, task, context in sorted({(e["model"], e["task"], e["context"]) for e in entries}):
        title = f"{model}, {task}, context {context}: ours (vLLM) vs kvpress on the same questions"
        header = ["compact_on (ours / kvpress)", "policy (ours)", "press", "budget", "n"]
        lines = table_head(title, [*header, "ours", "kvpress", "ours >= kvpress"])
        for e in entries:
            if (e["model"], e["task"], e["context"]) != (model, task, context):
                continue
            cells = [
                f"{e['compact_on']} / {e['kvpress_on']}",
                e["policy"],
                str(e["press"] or "none"),
                fmt(e["budget"]),
                str(e["n"]),
                fmt(e["ours"]),
                fmt(e["kvpress"]),
                "yes" if e["ours_ge"] else "**no**",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)
