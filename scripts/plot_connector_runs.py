"""Bar plot of ``lmcompact bench connector`` runs: TTFT and decode ms per token, recompute
vs store hit, one group per run (``LABEL=PATH``).

Usage: ``python scripts/plot_connector_runs.py --png OUT.png uniform=A.json per_head=B.json``.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", required=True)
    parser.add_argument("runs", nargs="+", help="LABEL=bench connector JSON")
    args = parser.parse_args()
    labels, rows = [], []
    for run in args.runs:
        label, path = run.split("=", 1)
        with open(path) as fh:
            rows.append(json.load(fh)["rows"][0])
        labels.append(label)
    fig, (ttft, decode) = plt.subplots(1, 2, figsize=(9, 3.6))
    width = 0.38
    xs = range(len(rows))
    for ax, keys, unit in (
        (ttft, ("ttft_recompute_s", "ttft_hit_s"), "TTFT (s)"),
        (decode, ("decode_ms_recompute", "decode_ms_hit"), "decode (ms / token)"),
    ):
        for i, (key, name) in enumerate(zip(keys, ("recompute", "store hit"), strict=True)):
            values = [float(r.get(key) or 0.0) for r in rows]
            bars = ax.bar([x + (i - 0.5) * width for x in xs], values, width, label=name)
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    first = rows[0]
    fig.suptitle(
        f"bench connector: {first['policy']} budget {first['budget']}, "
        f"{first['prompt_tokens']} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
