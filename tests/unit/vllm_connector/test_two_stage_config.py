"""``"compact_on": "both"``: options, store identity and the release accounting it needs."""

from __future__ import annotations

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.scheduler import _without

BOTH = {
    "policy": "snapkv",
    "budget": 0.25,
    "store": {"compact_on": "both"},
    "release": {"prefill": "pack"},
}


def test_defaults_store_a_query_agnostic_selection_in_about_the_budgets_bytes() -> None:
    config = ConnectorConfig.from_extra(BOTH)
    assert config.two_stage and config.store_compacts
    assert config.store_policy_name == "self_info"
    assert config.store.quantize == "int8"
    assert config.store_budget == pytest.approx(0.45)  # 1.8 x budget
    # whole blocks, rounded down, at least one block above the final budget's
    assert config.kept_per_chunk(16) == 112  # 7 of 16 blocks
    assert config.kept_per_chunk(32) == 96  # 3 of 8 (0.45 x 8 = 3.6)
    assert config.kept_per_chunk(64) == 128  # 2 of 4: the final budget keeps 1
    assert config.store_policy_object.name == "self_info"
    assert config.policy_object.name == "snapkv"  # the load's pack
    assert config.namespace_params() == {"budget": pytest.approx(0.45), "quantize": "int8"}
    loose = ConnectorConfig.from_extra({**BOTH, "budget": 0.75})
    assert loose.store_budget == 1.0 and loose.kept_per_chunk(32) == 256  # all, quantized


def test_the_recommended_path_is_the_default() -> None:
    """Nothing but a budget: a self_info selection stored int8, packed by the loading
    request with snapkv; a named policy stays on the save path; release off or a budget
    of 1 leave the save path."""
    default = ConnectorConfig.from_extra({"budget": 0.25})
    assert (default.policy, default.store.compact_on, default.store_policy_name) == (
        "snapkv",
        "both",
        "self_info",
    )
    assert default.release is not None and default.namespace_params() == (
        ConnectorConfig.from_extra(BOTH).namespace_params()
    )
    named = ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.25})
    assert named.store.compact_on == "save" and named.store.quantize is None
    off = ConnectorConfig.from_extra({"budget": 0.25, "release": False})
    assert (off.policy, off.store.compact_on, off.store.quantize) == ("self_info", "save", None)
    whole = ConnectorConfig.from_extra({"budget": 1.0})
    assert whole.store.compact_on == "save" and not whole.compacts


def test_the_store_selection_has_its_own_namespace() -> None:
    both = ConnectorConfig.from_extra(BOTH)
    save = ConnectorConfig.from_extra(
        {"policy": "self_info", "budget": 0.45, "store": {"quantize": "int8"}}
    )
    other = ConnectorConfig.from_extra(
        {**BOTH, "store": {"compact_on": "both", "policy": "knorm", "budget": 0.75}}
    )
    assert both.namespace_params() != other.namespace_params()
    assert both.store_policy_name == save.store_policy_name
    assert both.namespace_params() == save.namespace_params()  # the same stored chunks


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            {**BOTH, "budget": 0.5, "store": {"compact_on": "both", "budget": 0.5}},
            "must be above budget",
        ),
        ({**BOTH, "release": False}, '"release" group'),
        (
            {
                **BOTH,
                "store": {"compact_on": "both", "policy": "self_info", "token_scores": "client"},
            },
            "token_scores",
        ),
        ({**BOTH, "store": {"compact_on": "both", "policy": "nope"}}, "nope"),
        ({"policy": "snapkv", "store": {"budget": 0.5}}, 'apply to compact_on "both"'),
        (
            {**BOTH, "store": {"compact_on": "both", "per_head": {"slack": 2}}},
            "per_head",
        ),
    ],
)
def test_refusals(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ConnectorConfig.from_extra(extra)


def test_release_skips_what_the_load_hole_already_gave_back() -> None:
    assert _without(4, 20, None) == [(4, 20)]
    assert _without(4, 20, (8, 12)) == [(4, 8), (12, 20)]
    assert _without(8, 20, (8, 12)) == [(12, 20)]
    assert _without(4, 10, (8, 12)) == [(4, 8)]
    assert _without(9, 11, (8, 12)) == []


@pytest.mark.parametrize(
    ("extra", "warned"),
    [
        ({"policy": "snapkv", "budget": 0.5}, True),
        ({"policy": "tova", "budget": 0.5}, True),
        ({"policy": "expected_attention", "budget": 0.5}, False),
        ({"policy": "kvzip", "budget": 0.5}, False),
        (BOTH, False),
        ({"policy": "snapkv", "budget": 0.5, "store": False, "release": {}}, False),
    ],
)
def test_query_aware_store_selection_is_warned_about(
    extra: dict, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from connectors.vllm.spec import warn_query_aware_store

    with caplog.at_level("WARNING", logger="connectors.vllm.spec"):
        warn_query_aware_store(ConnectorConfig.from_extra(extra))
    lines = [r.getMessage() for r in caplog.records]
    assert bool(lines) == warned, lines
    if warned:
        assert 'compact_on": "both"' in lines[0] and "expected_attention" in lines[0]


def test_both_turns_the_release_group_on_when_it_is_not_named() -> None:
    implied = ConnectorConfig.from_extra({k: v for k, v in BOTH.items() if k != "release"})
    assert implied.release is not None and implied.two_stage


def test_sliding_window_engines_keep_the_two_stage_default() -> None:
    """Sliding-window models get the same default as every other model: the scheduler
    computes each prompt's last window itself, which keeps their windows exact."""
    from tests.unit.vllm_connector.fakes import spec

    built = spec({"budget": 0.25}, sliding_window=512)
    assert built.config.two_stage and built.config.store_compacts
    assert built.config.release is not None
