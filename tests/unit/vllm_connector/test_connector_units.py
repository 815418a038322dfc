"""The connector's options and its start-up checks against the engine (no engine: facts
given as :class:`EngineFacts`)."""

from __future__ import annotations

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.spec import check_against_engine
from lmcompact.policies import make_policy
from tests.unit.vllm_connector import fakes


def engine_checks(config: ConnectorConfig, **overrides: object) -> None:
    """:func:`check_against_engine` on a 2-layer engine of 2 KV heads of 16 (block 32)."""
    facts = fakes.facts(**{"block_size": 32, "num_kv_heads": 2, "head_dim": 16, **overrides})
    check_against_engine(config, config.policy_object, facts)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"polcy": "none"}, "unknown kv_connector_extra_config option"),
        ({"policy": "nope"}, "unknown policy 'nope'"),
        ({"budget": 1.5}, r"budget must be a kept fraction in \(0, 1\]"),
        ({"store": {"tiers": ["disk"]}}, r"store\.tiers must be"),
        ({"store": {"tiers": ["redis"]}}, "redis_url must be set exactly when"),
        ({"store": {"chunk_size": 0}}, r"store\.chunk_size must be a positive int"),
        (
            {"chunk_size": 256},
            r"\['chunk_size'\] are store options: give them inside the \"store\"",
        ),
        ({"policy": "snapkv", "policy_params": {"budget": 0.3}}, "top-level 'budget'"),
    ],
)
def test_bad_options_name_the_value(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ConnectorConfig.from_extra(extra)


def test_engine_checks() -> None:
    with pytest.raises(ValueError, match="multiple of the engine block size 32"):
        engine_checks(ConnectorConfig.from_extra({"store": {"chunk_size": 100}}))
    snap = ConnectorConfig.from_extra({"policy": "snapkv", "store": {"chunk_size": 64}})
    engine_checks(snap, prefix_caching=True)  # no longer refused (PrefixCacheGuard)
    with pytest.raises(ValueError, match="CUMULATIVE_SCORES"):
        engine_checks(ConnectorConfig.from_extra({"policy": "h2o", "store": {"chunk_size": 64}}))
    with pytest.raises(ValueError, match="different numbers of tokens per head or layer"):
        engine_checks(
            ConnectorConfig.from_extra({"policy": "adakv", "store": {"chunk_size": 256}}),
            num_layers=30,
            num_kv_heads=3,
            head_dim=64,
        )  # SmolLM2's shape
    adakv = ConnectorConfig.from_extra(
        {"policy": "adakv", "store": {"chunk_size": 256}, "release": {"per_head": {}}}
    )
    assert adakv.per_head_counts  # release.per_head masks the padding
    engine_checks(adakv, num_layers=30, num_kv_heads=3, head_dim=64)
    h2o = ConnectorConfig.from_extra({"policy": "h2o", "store": {"chunk_size": 64, "per_head": {}}})
    assert h2o.per_head_counts
    with pytest.raises(ValueError, match="CUMULATIVE_SCORES"):  # needs are still checked
        engine_checks(h2o, head_dim=8)


def test_engine_checks_accept_query_agnostic_policies_and_need_a_window() -> None:
    for name in ("kvzip", "expected_attention"):
        engine_checks(
            ConnectorConfig.from_extra(
                {"policy": name, "budget": 0.5, "store": {"chunk_size": 128}}
            )
        )
    config = ConnectorConfig.from_extra(
        {"policy": "expected_attention", "budget": 0.5, "store": {"chunk_size": 128}, "window": 0}
    )
    with pytest.raises(ValueError, match="window must be >= 1"):
        engine_checks(config)


def test_kept_per_chunk_is_block_aligned() -> None:
    assert ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.5}).kept_per_chunk(32) == 128
    assert ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.25}).kept_per_chunk(32) == 64
    assert ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.01}).kept_per_chunk(32) == 32
    assert ConnectorConfig.from_extra({"policy": "none", "budget": 0.3}).kept_per_chunk(32) == 256
    # the rounding above is refused at start-up where it changes the budget
    with pytest.raises(ValueError, match=r"budget 0\.01 cannot be honoured"):
        engine_checks(ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.01}))


def test_snapkv_pools_over_15_by_default_in_the_connector() -> None:
    """The connector's snapkv default kernel is 15 (POLICY_DEFAULTS, measured in
    docs/eval/RESULTS.md); policy_params override it, and the stored chunks of two kernels
    live in two namespaces."""
    base = {"policy": "snapkv", "budget": 0.25}
    default = ConnectorConfig.from_extra(base)
    assert default.make_policy().kernel_size == 15  # type: ignore[attr-defined]
    paper = ConnectorConfig.from_extra({**base, "policy_params": {"kernel_size": 7}})
    assert paper.make_policy().kernel_size == 7  # type: ignore[attr-defined]
    assert default.namespace_params() == {"kernel_size": 15, "budget": 0.25}
    assert paper.namespace_params() != default.namespace_params()
    # other policies keep their own defaults
    knorm = ConnectorConfig.from_extra({"policy": "knorm", "budget": 0.25})
    assert knorm.effective_params == {}


def test_expected_attention_shares_one_token_set_by_default_in_the_connector() -> None:
    """expected_attention runs shared and pooled over 15 in the connector (POLICY_DEFAULTS,
    measured in docs/eval/RESULTS.md); policy_params override it; kvzip and the class keep
    their per-head defaults."""
    ea = ConnectorConfig.from_extra({"policy": "expected_attention", "budget": 0.25})
    assert ea.make_policy().params()["share"] is True
    assert ea.namespace_params() == {"share": True, "kernel_size": 15, "budget": 0.25}
    per_head = ConnectorConfig.from_extra(
        {"policy": "expected_attention", "budget": 0.25, "policy_params": {"share": False}}
    ).make_policy()
    assert per_head.params()["share"] is False and per_head.params()["kernel_size"] == 15
    kvzip = ConnectorConfig.from_extra({"policy": "kvzip", "budget": 0.25}).make_policy()
    assert kvzip.params()["allocation"] == "head" and kvzip.params()["share"] is False
    assert make_policy("expected_attention").params()["share"] is False
