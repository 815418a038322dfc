"""The figures of ``lmcompact bench hf-beam``: its configurations, goals, summary, plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmcompact.bench.hf_beam_score import fidelity_goals

CONFIGS = (
    "dynamic",
    "dynamic_math",
    "paged",
    "paged_eager",
    "paged_int8",
    "paged_compact",
    "paged_int8_compact",
)
GOALS = {
    "beam_time_ratio": 0.8,
    "paged_int8 time": 1.0,
    "paged_int8": 0.15,
    "paged_int8_compact": 0.3,
}


def plot_rows(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bars per configuration and prompt length: decode time per token, peak KV bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["prompt_tokens"] for r in rows})
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        for ax, key, scale in (
            (axes[0], "decode_s_per_token", 1e3),
            (axes[1], "peak_kv_bytes", 2.0**-20),
        ):
            ys = [
                next(
                    (
                        r[key] * scale
                        for r in rows
                        if r["config"] == config and r["prompt_tokens"] == t
                    ),
                    0.0,
                )
                for t in lengths
            ]
            ax.bar([j + i * width for j in range(len(lengths))], ys, width, label=config)
    for ax, label in ((axes[0], "decode time per token (ms)"), (axes[1], "peak KV (MiB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))])
        ax.set_xticklabels([f"{t} prompt tokens" for t in lengths])
        ax.set_ylabel(label)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(rows: list[dict[str, Any]], length: int) -> dict[str, Any]:
    """Ratios to ``dynamic`` at prompt ``length`` (time per token, peak KV bytes) and
    which of :data:`GOALS` they meet."""
    at = {r["config"]: r for r in rows if r["prompt_tokens"] == length}
    base = at["dynamic"]
    time_ratio = (
        at["paged"]["decode_s_per_token"] / base["decode_s_per_token"] if "paged" in at else None
    )
    paged = {c: r for c, r in at.items() if not c.startswith("dynamic")}
    memory = {c: r["peak_kv_bytes"] / base["peak_kv_bytes"] for c, r in paged.items()}
    times = {c: r["decode_s_per_token"] / base["decode_s_per_token"] for c, r in paged.items()}
    goals: dict[str, Any] = {"at_prompt_tokens": length}
    if time_ratio is not None:
        goals["beam_time_ratio<=0.8"] = time_ratio <= GOALS["beam_time_ratio"]
    if "paged_int8" in times:
        limit = GOALS["paged_int8 time"]
        goals[f"paged_int8 time<={limit}"] = times["paged_int8"] <= limit
    for config in ("paged_int8", "paged_int8_compact"):
        if config in memory:
            goals[f"{config} memory<={GOALS[config]}"] = memory[config] <= GOALS[config]
    goals.update(fidelity_goals(rows, length))
    return {
        "beam_time_ratio": time_ratio,
        "beam_time_ratios": times,
        "beam_kv_memory_ratio": memory,
        "goals": goals,
    }
