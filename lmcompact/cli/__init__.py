"""The ``lmcompact`` command line.

Each subcommand is a module in this package that defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; modules are discovered, so a
new command is a new file. Heavy imports (transformers, vLLM) stay inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType


def discover_commands(package: str) -> list[ModuleType]:
    """Import every module of ``package`` that defines a ``NAME`` (sorted by name).

    A module whose import fails for a missing package (say msgpack on a GPU
    box) becomes a stub command that reports the error when run, so the other
    commands still work.
    """
    pkg = importlib.import_module(package)
    found: list[ModuleType] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{package}.{info.name}")
        except ImportError as exc:
            module = _unavailable(info.name, exc)
        if hasattr(module, "NAME") and hasattr(module, "run"):
            found.append(module)
    return sorted(found, key=lambda m: str(m.NAME))


def _unavailable(name: str, error: ImportError) -> ModuleType:
    """A stand-in command for a module that cannot be imported here."""
    stub = ModuleType(name)
    stub.NAME = name.replace("_", "-")  # type: ignore[attr-defined]
    stub.HELP = f"(unavailable here: {error})"  # type: ignore[attr-defined]

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("rest", nargs=argparse.REMAINDER)

    def run(args: argparse.Namespace) -> int:
        raise SystemExit(f"lmcompact {stub.NAME}: cannot run here: {error}")

    stub.add_arguments = add_arguments  # type: ignore[attr-defined]
    stub.run = run  # type: ignore[attr-defined]
    return stub


def add_command_group(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], package: str
) -> None:
    """Add one subparser per discovered command module of ``package``."""
    for module in discover_commands(package):
        parser = subparsers.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(parser)
        parser.set_defaults(_run=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcompact", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_command_group(subparsers, "lmcompact.cli")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
