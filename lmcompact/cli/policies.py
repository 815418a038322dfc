"""``lmcompact policies``: list every compaction policy, its parameters and needs."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

NAME = "policies"
HELP = "list compaction policies: name, parameters with defaults, needs, phases"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print a JSON list of objects (one per policy)"
    )


def describe_all() -> list[dict[str, Any]]:
    """``CompactionPolicy.describe()`` of every available policy, sorted by name.

    A plugin that fails to load is listed with an ``error`` instead of failing
    the whole listing.
    """
    from lmcompact.policies import available_policies, get_policy_class

    rows: list[dict[str, Any]] = []
    for name in available_policies():
        try:
            rows.append(get_policy_class(name).describe())
        except Exception as error:  # a broken third-party plugin must not hide the others
            logger.warning("policy %r failed to load: %s", name, error)
            rows.append({"name": name, "error": str(error)})
    return rows


def _format_params(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
        for key, value in params.items()
    )


def run(args: argparse.Namespace) -> int:
    from lmcompact.results import format_table

    rows = describe_all()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    table = [
        {
            "name": row["name"],
            "parameters": _format_params(row.get("params", {})),
            "needs": ", ".join(row.get("needs", [])) or "-",
            "phases": ", ".join(row.get("phases", [])) or "-",
            "summary": row.get("summary", row.get("error", "")),
        }
        for row in rows
    ]
    print(format_table(table))
    return 0
