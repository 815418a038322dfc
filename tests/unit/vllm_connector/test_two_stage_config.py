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


def test_defaults_store_half_with_a_query_agnostic_policy() -> None:
    config = ConnectorConfig.from_extra(BOTH)
    assert config.two_stage and config.store_compacts
    assert config.store_policy_name == "self_info"
    assert config.store_budget == 0.5
    assert config.kept_per_chunk(32) == 128  # stored chunks keep the store budget
    assert config.store_policy_object.name == "self_info"
    assert config.policy_object.name == "snapkv"  # the load's pack
    assert config.namespace_params()["budget"] == 0.5


def test_the_store_selection_has_its_own_namespace() -> None:
    both = ConnectorConfig.from_extra(BOTH)
    save = ConnectorConfig.from_extra({"policy": "self_info", "budget": 0.5})
    other = ConnectorConfig.from_extra(
        {**BOTH, "store": {"compact_on": "both", "policy": "knorm", "budget": 0.75}}
    )
    assert both.namespace_params() != other.namespace_params()
    assert both.store_policy_name == save.store_policy_name
    assert both.namespace_params() == save.namespace_params()  # the same stored chunks


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({**BOTH, "budget": 0.5}, "must be above budget"),
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
