"""Check lmcompact's connector options before vLLM starts (seconds, not a model load later).

vLLM builds the connector only after the engine loaded weights and warmed up, so a typo in
``kv_connector_extra_config`` used to surface 20-80 s into start-up, mid-log. The CLI, the
launcher and the offline builder call :func:`check_transfer_config` first: everything that
does not need the engine (option names, types, ranges, the policy and its parameters) is
checked here; block-size and model-shape checks still run when the connector is built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from lmcompact.vllm.config import ConnectorConfig

CONNECTOR_NAMES = ("LMCompactConnector", "LMCompactMemoryConnector")
TRANSFER_FLAG = "--kv-transfer-config"


def check_extra_config(connector: str, extra: Mapping[str, Any] | None) -> None:
    """Validate ``kv_connector_extra_config`` for one of our connectors.

    Raises:
        ValueError: naming the bad key or value and what is allowed.
    """
    if connector not in CONNECTOR_NAMES:
        raise ValueError(f"kv_connector must be one of {list(CONNECTOR_NAMES)}, got {connector!r}")
    if extra is not None and not isinstance(extra, Mapping):
        raise ValueError(f"kv_connector_extra_config must be an object, got {extra!r}")
    # the old name turns the release group on by default ("memory" is its old spelling)
    ConnectorConfig.from_extra(extra, release=connector == "LMCompactMemoryConnector")


def check_transfer_config(transfer: Mapping[str, Any] | str) -> bool:
    """Validate a ``--kv-transfer-config`` value (JSON text or a dict).

    Returns True when it names one of our connectors and its options are valid, False when
    it names another connector (left to vLLM).

    Raises:
        ValueError: bad JSON, or bad options for one of our connectors.
    """
    if isinstance(transfer, str):
        try:
            transfer = json.loads(transfer)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{TRANSFER_FLAG} is not valid JSON: {exc}") from None
    if not isinstance(transfer, Mapping):
        raise ValueError(f"{TRANSFER_FLAG} must be a JSON object, got {transfer!r}")
    connector = transfer.get("kv_connector")
    if connector not in CONNECTOR_NAMES:
        return False
    check_extra_config(str(connector), transfer.get("kv_connector_extra_config"))
    return True


def transfer_config_arg(argv: Sequence[str]) -> str | None:
    """The value of ``--kv-transfer-config`` in a command line, or None."""
    for index, arg in enumerate(argv):
        if arg == TRANSFER_FLAG and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(TRANSFER_FLAG + "="):
            return arg.split("=", 1)[1]
    return None
