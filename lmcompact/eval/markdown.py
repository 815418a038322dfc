"""Markdown tables of the eval reports (``report.py``, ``vllm_report.py``)."""

from __future__ import annotations

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
