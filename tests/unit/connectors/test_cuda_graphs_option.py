"""``cuda_graphs``: which CUDA graph mode each connector configuration asks vLLM for."""

from __future__ import annotations

import pytest

from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.connector import LMCompactConnector, LMCompactMemoryConnector


def test_default_is_piecewise_and_full_is_opt_in() -> None:
    assert ConnectorConfig.from_extra({}).cuda_graphs == "piecewise"
    assert LMCompactConnector.requires_piecewise_for_cudagraph({})
    assert not LMCompactConnector.requires_piecewise_for_cudagraph({"cuda_graphs": "full"})
    assert not LMCompactMemoryConnector.requires_piecewise_for_cudagraph(
        {"policy": "snapkv", "budget": 0.25, "cuda_graphs": "full", "release": {"prefill": "pack"}}
    )


@pytest.mark.parametrize(
    "memory", [{"per_head": {"slack": 1.5}}, {"decode_policy": "h2o", "decode_budget_tokens": 64}]
)
def test_modes_working_inside_attention_calls_stay_piecewise(memory: dict[str, object]) -> None:
    extra = {"policy": "snapkv", "budget": 0.25, "cuda_graphs": "full", "memory": memory}
    assert LMCompactMemoryConnector.requires_piecewise_for_cudagraph(extra)
    extra = {"policy": "snapkv", "budget": 0.25, "cuda_graphs": "full", "release": memory}
    assert LMCompactConnector.requires_piecewise_for_cudagraph(extra)
    assert not LMCompactConnector.requires_piecewise_for_cudagraph({**extra, "release": False})


def test_bad_value_names_the_key() -> None:
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        ConnectorConfig.from_extra({"cuda_graphs": "always"})
