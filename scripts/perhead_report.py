"""Per-head against uniform counts from one ``lmcompact bench connector --configs`` run.

Reads the bench JSON (rows labelled by ``--configs``), pairs each per-head row with the
uniform row it is compared to (``PER_HEAD=UNIFORM``, both labels of that run, measured in
the same invocation), and writes a JSON with ``blocks_held_fraction`` and
``decode_ratio_vs_uniform`` (objects keyed by the per-head label), the hit's TTFT speed-up
over recomputing, and a bar plot beside it.

Usage: ``python scripts/perhead_report.py STORE.json,INPLACE.json --out
docs/benchmarks/perhead-h200.json kvzip_ragged=kvzip_head adakv_inplace=snapkv_inplace``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def report(bench: dict[str, Any], pairs: dict[str, str]) -> dict[str, Any]:
    """The per-head figures of ``bench`` for each ``per-head label -> uniform label``."""
    rows = {r["policy"]: r for r in bench["rows"]}
    missing = sorted({*pairs, *pairs.values()} - set(rows))
    if missing:
        raise SystemExit(f"labels not in the bench JSON: {missing}; it has {sorted(rows)}")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "blocks_held_fraction": {k: rows[k]["blocks_held_fraction"] for k in rows},
        "decode_ratio_vs_uniform": {
            k: ratio(rows[k].get("decode_ms_hit"), rows[u].get("decode_ms_hit"))
            for k, u in pairs.items()
        },
        "ttft_hit_speedup": {k: rows[k].get("speedup") for k in rows},
        "decode_ms_hit": {k: rows[k].get("decode_ms_hit") for k in rows},
        "compared_with": pairs,
        "settings": bench.get("settings"),
        "device": bench.get("device"),
        "rows": bench["rows"],
    }


def plot(figures: dict[str, Any], path: Path) -> None:
    labels = list(figures["blocks_held_fraction"])
    fig, (held, decode) = plt.subplots(1, 2, figsize=(10, 3.8))
    bars = held.bar(labels, [figures["blocks_held_fraction"][k] for k in labels])
    held.bar_label(bars, fmt="%.3f", fontsize=8)
    held.set_ylabel("blocks held / full prompt's")
    held.set_title("KV blocks a loaded or packed request holds")
    ms = [figures["decode_ms_hit"][k] or 0.0 for k in labels]
    bars = decode.bar(labels, ms)
    decode.bar_label(bars, fmt="%.3g", fontsize=8)
    decode.set_ylabel("decode ms / token")
    decode.set_title("decode after the hit or pack")
    for ax in (held, decode):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "bench",
        help="lmcompact bench connector --json output(s), comma-separated: their rows "
        "are joined (each pair must come from one run)",
    )
    parser.add_argument("pairs", nargs="+", help="PER_HEAD=UNIFORM row labels")
    parser.add_argument("--out", required=True, help="JSON to write (the PNG goes beside it)")
    args = parser.parse_args()
    pairs = dict(p.split("=", 1) for p in args.pairs)
    runs = [json.loads(Path(path).read_text()) for path in args.bench.split(",")]
    bench = {**runs[0], "rows": [row for run in runs for row in run["rows"]]}
    figures = report(bench, pairs)
    out = Path(args.out)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    plot(figures, out.with_suffix(".png"))
    for key in ("blocks_held_fraction", "decode_ratio_vs_uniform", "ttft_hit_speedup"):
        print(key, json.dumps(figures[key]))


if __name__ == "__main__":
    main()
