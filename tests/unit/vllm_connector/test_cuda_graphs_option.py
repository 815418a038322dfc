"""``cuda_graphs``: which CUDA graph mode each connector configuration asks vLLM for."""

from __future__ import annotations

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.connector import LMCompactConnector


def test_default_is_piecewise_and_full_is_opt_in() -> None:
    assert ConnectorConfig.from_extra({}).cuda_graphs == "piecewise"
    assert LMCompactConnector.requires_piecewise_for_cudagraph({})
    assert not LMCompactConnector.requires_piecewise_for_cudagraph({"cuda_graphs": "full"})
    assert not LMCompactConnector.requires_piecewise_for_cudagraph(
        {"policy": "snapkv", "budget": 0.25, "cuda_graphs": "full", "release": {"prefill": "pack"}}
    )


def test_per_head_counts_keep_full_graphs() -> None:
    """Their attention reads device tables (lmcompact.compaction.per_head_tables)."""
    release = {"policy": "adakv", "budget": 0.25, "cuda_graphs": "full"}
    assert not LMCompactConnector.requires_piecewise_for_cudagraph(
        {**release, "release": {"per_head": {"slack": 1.5}}}
    )
    store = {"policy": "kvzip", "budget": 0.25, "cuda_graphs": "full"}
    assert not LMCompactConnector.requires_piecewise_for_cudagraph(
        {**store, "store": {"per_head": {"slack": 3}}}
    )


@pytest.mark.parametrize("release", [{"decode_policy": "h2o", "decode_budget_tokens": 64}])
def test_modes_working_inside_attention_calls_stay_piecewise(release: dict[str, object]) -> None:
    extra = {"policy": "snapkv", "budget": 0.25, "cuda_graphs": "full", "release": release}
    assert LMCompactConnector.requires_piecewise_for_cudagraph(extra)
    assert not LMCompactConnector.requires_piecewise_for_cudagraph({**extra, "release": False})
    # options the connector refuses when it is built (the removed "memory" group) ask for
    # the safe mode: vLLM asks before the connector exists
    old = {"policy": "snapkv", "budget": 0.25, "cuda_graphs": "full", "memory": release}
    with pytest.raises(ValueError, match=r'"memory" is now the "release" group'):
        ConnectorConfig.from_extra(old)
    assert LMCompactConnector.requires_piecewise_for_cudagraph(old)


def test_bad_value_names_the_key() -> None:
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        ConnectorConfig.from_extra({"cuda_graphs": "always"})
