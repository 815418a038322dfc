"""``cuda_graphs``: which CUDA graph mode each connector configuration asks vLLM for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.connector import LMCompactConnector


def test_full_and_piecewise_are_what_they_say() -> None:
    assert LMCompactConnector.requires_piecewise_for_cudagraph({"cuda_graphs": "piecewise"})
    assert not LMCompactConnector.requires_piecewise_for_cudagraph({"cuda_graphs": "full"})
    assert not LMCompactConnector.requires_piecewise_for_cudagraph(
        {"policy": "snapkv", "budget": 0.25, "cuda_graphs": "full", "release": {"prefill": "pack"}}
    )


@dataclass
class _Text:
    sliding_window: int | None = None
    use_sliding_window: bool = True


@dataclass
class _Model:
    hf_text_config: _Text


@dataclass
class _Device:
    device_type: str = "cuda"


@dataclass
class VllmConfig:
    """Stands in for vLLM's config under construction: the connector reads the caller's
    ``self`` (the GPU test tests/gpu/test_serve_graphs.py checks the real one)."""

    model_config: _Model | None
    device_config: _Device
    use_v2_model_runner: bool = True

    def asks(self, extra: dict[str, object]) -> bool:  # as VllmConfig.__post_init__ does
        return LMCompactConnector.requires_piecewise_for_cudagraph(extra)


def _config(window: int | None = None, **changes: object) -> VllmConfig:
    config = VllmConfig(_Model(_Text(window)), _Device())
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def test_auto_is_the_default_and_reads_the_engine_being_configured() -> None:
    assert ConnectorConfig.from_extra({}).cuda_graphs == "auto"
    assert not _config().asks({})  # full graphs where the engine allows them
    assert not _config().asks({"policy": "snapkv", "release": {"prefill": "pack"}})
    assert _config(window=512).asks({})  # sliding-window layers: cut inside attention
    assert not _config(window=512, model_config=_Model(_Text(4096, False))).asks({})
    assert _config(use_v2_model_runner=False).asks({})
    assert _config(device_config=_Device("cpu")).asks({})
    assert _config(model_config=None).asks({})
    # asked from anywhere else (no config being built): the safe mode
    assert LMCompactConnector.requires_piecewise_for_cudagraph({})
    # options that need piecewise graphs whatever the model
    h2o = {"release": {"decode_policy": "h2o", "decode_budget_tokens": 64}}
    assert _config().asks({"policy": "snapkv", "budget": 0.25, **h2o})


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
