"""The ``compact_on`` option: stored chunks whole at ``load``, never in a compacted namespace."""

from __future__ import annotations

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.spec import build_namespace, check_against_engine
from tests.unit.vllm_connector import fakes

FACTS = fakes.facts(model_id="m", num_kv_heads=2, head_dim=16)


def test_compact_on_is_validated() -> None:
    with pytest.raises(
        ValueError, match=r"store\.compact_on must be one of \['auto', 'save', 'load', 'both'\]"
    ):
        ConnectorConfig.from_extra({"policy": "snapkv", "store": {"compact_on": "later"}})


def test_load_stores_whole_chunks_in_the_namespace_of_policy_none() -> None:
    load = ConnectorConfig.from_extra(
        {"policy": "snapkv", "budget": 0.25, "store": {"compact_on": "load"}, "release": {}}
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
        {"policy": "knorm", "budget": 0.5, "store": {"compact_on": "load"}, "release": {}}
    )
    assert build_namespace(other, FACTS).digest() == digest["none"]


def test_load_still_checks_the_policy_shape() -> None:
    config = ConnectorConfig.from_extra(
        {
            "policy": "snapkv",
            "budget": 0.25,
            "store": {"chunk_size": 64, "compact_on": "load"},
            "release": {},
        }
    )
    check_against_engine(config, config.policy_object, FACTS)
    adakv = ConnectorConfig.from_extra(
        {"policy": "adakv", "store": {"compact_on": "load"}, "release": {}}
    )
    smollm2 = fakes.facts(num_layers=30, num_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match="different numbers of tokens"):
        check_against_engine(adakv, adakv.policy_object, smollm2)


def test_eval_modes_are_valid_connector_options() -> None:
    from lmcompact.compaction.hole_planner import PrefillMode
    from lmcompact.eval.vllm_runner import MODES, VllmEvalConfig, connector_extra

    config = VllmEvalConfig()
    for mode in MODES:
        extra = connector_extra(mode, "snapkv", 0.25, config, "ns")
        parsed = ConnectorConfig.from_extra(extra)
        # inplace: no store; both and default: stored compacted, then packed at load
        compacted = ("save", "both", "default")
        assert parsed.store_compacts == (mode in compacted) or mode == "inplace"
        assert (parsed.release_mode is PrefillMode.PACK) == (mode != "save")
        assert parsed.store.enabled == (mode != "inplace")
