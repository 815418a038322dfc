"""``lmcompact bench <name>``: benchmarks, one module each in ``lmcompact.bench``."""

from __future__ import annotations

import argparse

from lmcompact.cli import add_command_group

NAME = "bench"
HELP = "run a benchmark (prints a table and writes JSON with --json)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    add_command_group(sub, "lmcompact.bench")


def run(args: argparse.Namespace) -> int:  # pragma: no cover - dispatched by subparser
    raise SystemExit("choose a benchmark: lmcompact bench --help")
