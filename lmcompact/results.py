"""Writing results: JSON files and markdown tables (the commands, benchmarks and scripts)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_json(path: str | Path | None, payload: Any) -> None:
    """Write ``payload`` as indented JSON to ``path`` ('-' means stdout; None does nothing)."""
    if path is None:
        return
    text = json.dumps(payload, indent=2, sort_keys=False, default=str)
    if str(path) == "-":
        print(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Render rows as a markdown table; floats get 4 significant digits."""
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns is not None else list(rows[0])

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
