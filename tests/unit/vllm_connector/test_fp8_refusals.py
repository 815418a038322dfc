"""Every combination the connector refuses on an fp8 KV cache says so at start-up."""

from __future__ import annotations

from typing import Any

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.kv_dtype import refuse_fp8_scales
from lmcompact.compaction.kv_quant import Fp8Pages
from tests.unit.vllm_connector.fakes import spec

IN_PLACE = {"policy": "snapkv", "budget": 0.5, "store": False, "release": {"prefill": "pack"}}
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "release per-head counts": (
        {**IN_PLACE, "policy": "adakv", "release": {"prefill": "pack", "per_head": {}}},
        "release.per_head",
    ),
    "store per-head counts": (
        {"policy": "adakv", "budget": 0.5, "store": {"chunk_size": 64, "per_head": {}}},
        "store.per_head",
    ),
    "h2o decode": (
        {
            **IN_PLACE,
            "release": {"prefill": "pack", "decode_budget_tokens": 256, "decode_policy": "h2o"},
        },
        "decode_policy 'h2o'",
    ),
    "window-scored decode": (
        {
            **IN_PLACE,
            "release": {
                "prefill": "pack",
                "decode_budget_tokens": 256,
                "decode_policy": "decoding_snapkv",
            },
        },
        "decode_policy 'decoding_snapkv'",
    ),
    "store quantization": (
        {"policy": "none", "store": {"chunk_size": 64, "quantize": "int8"}},
        "store.quantize 'int8'",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_fp8_refusals_name_the_combination(case: str) -> None:
    extra, named = REFUSED[case]
    spec(extra)  # accepted with the model dtype's cache
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' cannot be combined") as error:
        spec(extra, kv_cache_dtype="fp8")
    assert named in str(error.value)


def test_fp8_accepts_sliding_window_models() -> None:
    spec(IN_PLACE, kv_cache_dtype="fp8_e5m2", sliding_window=512)


@pytest.mark.parametrize(
    "extra",
    [
        IN_PLACE,
        {"policy": "none", "store": {"chunk_size": 64}},
        {"policy": "snapkv", "budget": 0.5, "store": {"chunk_size": 64}},
        {
            "policy": "streaming_llm",
            "budget": 0.5,
            "store": False,
            "release": {"prefill": "blocks"},
        },
    ],
)
def test_fp8_accepts_uniform_in_place_and_store(extra: dict[str, Any]) -> None:
    built = spec(extra, kv_cache_dtype="fp8")
    assert built.facts.fp8
    if built.config.store.enabled:  # stored bytes are named by their fp8 format
        assert all(ns.kv_dtype == "float8_e4m3fn" for ns in built.namespaces)


def test_fp8_store_refuses_scales_it_cannot_carry() -> None:
    store = ConnectorConfig.from_extra({"policy": "none", "store": {"chunk_size": 64}})
    unit = Fp8Pages.of("fp8", [1.0, 1.0], [1.0, 1.0])
    refuse_fp8_scales(store, unit, calculated_scales=False)
    refuse_fp8_scales(store, None, calculated_scales=True)  # not an fp8 cache
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        refuse_fp8_scales(store, unit, calculated_scales=True)
    with pytest.raises(ValueError, match=r"KV scales of 1\.0, found key scales \[0\.5, 1\.0\]"):
        refuse_fp8_scales(store, Fp8Pages.of("fp8", [0.5, 1.0], [1.0, 1.0]), False)
    in_place = ConnectorConfig.from_extra(IN_PLACE)  # no stored bytes: any scales
    refuse_fp8_scales(in_place, Fp8Pages.of("fp8", [0.5], [2.0]), calculated_scales=True)


def test_default_store_quantization_is_skipped_on_fp8() -> None:
    """The default stored-prefix path quantizes rows to int8 ("auto"); on an fp8 cache the
    rows are fp8 already, so "auto" becomes none there and a named quantize is refused."""
    from connectors.vllm.kv_dtype import fp8_store_defaults
    from tests.unit.vllm_connector.fakes import facts

    extra = {"budget": 0.5}  # policy, compact_on and quantize "auto": two-stage, int8
    assert ConnectorConfig.from_extra(extra).store.quantize == "int8"
    on_fp8 = fp8_store_defaults(extra, facts(kv_cache_dtype="fp8"))
    assert ConnectorConfig.from_extra(on_fp8).store.quantize is None
    spec(on_fp8, kv_cache_dtype="fp8")
    assert fp8_store_defaults(extra, facts()) == extra  # other caches: unchanged
    named = {"budget": 0.5, "store": {"quantize": "int8"}}
    assert fp8_store_defaults(named, facts(kv_cache_dtype="fp8")) == named
    assert fp8_store_defaults({"store": False}, facts(kv_cache_dtype="fp8")) == {"store": False}
