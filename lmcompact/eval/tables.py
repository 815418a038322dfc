"""Result rows of the eval reports (``report.py``, ``vllm_report.py``): grouping and
markdown tables."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any


def fmt(value: Any) -> str:
    """A table cell: "" for None, 3 significant digits for floats under 1000."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table_head(title: str, header: Sequence[str]) -> list[str]:
    """The lines of a ``### title`` section up to the header separator."""
    return [f"### {title}", "", table_row(header), "|" + "---|" * len(header)]


def table_row(cells: Sequence[str]) -> str:
    """One table row."""
    return "| " + " | ".join(cells) + " |"


def group_by(
    rows: Sequence[dict[str, Any]], key: Sequence[str]
) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Rows grouped by their values of ``key`` (a missing field groups as None), in order."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for item in rows:
        groups[tuple(item.get(k) for k in key)].append(item)
    return groups
