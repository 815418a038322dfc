"""The ``compact_on`` option: stored chunks whole at ``load``, never in a compacted namespace."""

from __future__ import annotations

import pytest
import torch

from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.connector import build_namespace
from lmcompact.vllm.engine_checks import validate_against_engine
from lmcompact.vllm.vllm_shim import EngineFacts

FACTS = EngineFacts(
    model_id="m",
    block_size=32,
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    dtype=torch.float32,
    prefix_caching=False,
    device_type="cpu",
)


def test_compact_on_is_validated() -> None:
    with pytest.raises(ValueError, match=r"compact_on must be one of \['save', 'load'\]"):
        ConnectorConfig.from_extra({"policy": "snapkv", "compact_on": "later"})


def test_load_stores_whole_chunks_in_the_namespace_of_policy_none() -> None:
    load = ConnectorConfig.from_extra(
        {"policy": "snapkv", "budget": 0.25, "compact_on": "load", "release": {}}
    )
    save = ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.25})
    none = ConnectorConfig.from_extra({"policy": "none"})
    assert load.compacts and not load.store_compacts
    assert save.store_compacts
    assert load.kept_per_chunk(32) == load.store.chunk_size
    assert save.kept_per_chunk(32) == 64
    assert load.store_policy().name == "none"
    assert save.store_policy().name == "snapkv"
    digest = {
        name: build_namespace(c, FACTS).digest()
        for name, c in (("load", load), ("save", save), ("none", none))
    }
    assert digest["load"] == digest["none"]  # whole chunks are the same bytes
    assert digest["save"] != digest["none"]  # compacted chunks never mix with whole ones
    other = ConnectorConfig.from_extra(
        {"policy": "knorm", "budget": 0.5, "compact_on": "load", "release": {}}
    )
    assert build_namespace(other, FACTS).digest() == digest["none"]


def test_load_still_checks_the_policy_shape() -> None:
    config = ConnectorConfig.from_extra(
        {"policy": "snapkv", "budget": 0.25, "chunk_size": 64, "compact_on": "load", "release": {}}
    )
    validate_against_engine(config, block_size=32, num_layers=2, num_kv_heads=2, head_dim=16)
    adakv = ConnectorConfig.from_extra({"policy": "adakv", "compact_on": "load", "release": {}})
    with pytest.raises(ValueError, match="different numbers of tokens"):
        validate_against_engine(  # SmolLM2's shape
            adakv, block_size=32, num_layers=30, num_kv_heads=3, head_dim=64
        )


def test_eval_modes_are_valid_connector_options() -> None:
    from lmcompact.eval.vllm_runner import MODES, VllmEvalConfig, connector_extra
    from lmcompact.vllm.memory.planner import PrefillMode

    config = VllmEvalConfig()
    for mode in MODES:
        extra = connector_extra(mode, "snapkv", 0.25, config, "ns")
        parsed = ConnectorConfig.from_extra(extra)
        assert parsed.store_compacts == (mode == "save") or mode == "inplace"  # inplace: no store
        assert (parsed.release_mode is PrefillMode.PACK) == (mode != "save")
        assert parsed.store.enabled == (mode != "inplace")
