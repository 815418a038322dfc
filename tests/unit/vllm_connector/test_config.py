"""The option groups: ``store`` and ``release`` parsing, validation, the prefill mode chosen per
policy, and the refusal of the old spellings (flat store keys, the ``"memory"`` group)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from connectors.vllm.config import ConnectorConfig, ReleaseOptions, StoreOptions
from connectors.vllm.spec import build_namespace
from lmcompact.compaction.hole_planner import PrefillMode
from lmcompact.options import parse
from tests.unit.vllm_connector import fakes

BS = 4


def release(options: dict[str, Any] | None) -> ReleaseOptions:
    return parse(ReleaseOptions, options, "release", prefix="release.")


def test_groups_are_parsed_into_one_config() -> None:
    config = ConnectorConfig.from_extra(
        {
            "policy": "snapkv",
            "budget": 0.5,
            "store": {"chunk_size": 512, "tiers": "cpu", "save": False},
            "release": {"decode_budget_tokens": 256},
        }
    )
    # a named policy runs on the save path, exact bytes (compact_on and quantize "auto")
    assert config.store == StoreOptions(
        chunk_size=512, save=False, compact_on="save", quantize=None
    )
    assert config.release is not None and config.release.decode_budget_tokens == 256
    assert config.release_mode is PrefillMode.PACK
    assert ConnectorConfig.from_extra({"policy": "none"}).release is None  # off unless given
    assert ConnectorConfig.from_extra({"release": {}}).release == ReleaseOptions()
    assert ConnectorConfig.from_extra({"release": True}).release == ReleaseOptions()
    assert ConnectorConfig.from_extra({"release": False}).release is None


def test_store_group_and_store_off() -> None:
    grouped = ConnectorConfig.from_extra({"store": {"chunk_size": 512, "tiers": ["cpu"]}})
    # policy "auto": the two-stage path, int8 in the store
    assert grouped.store == StoreOptions(chunk_size=512, compact_on="both", quantize="int8")
    off = ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.25, "store": False})
    assert not off.store.enabled and off.store.chunk_size == 256
    with pytest.raises(ValueError, match=r"store\.chunk_size must be a positive int"):
        ConnectorConfig.from_extra({"store": {"chunk_size": 0}})
    with pytest.raises(ValueError, match="unknown store option"):
        ConnectorConfig.from_extra({"store": {"prefill": "pack"}})
    with pytest.raises(ValueError, match="store must be an object, true or false"):
        ConnectorConfig.from_extra({"store": "cpu"})


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"chunk_size": 512}, "['chunk_size']"),
        ({"chunk_size": 512, "tiers": ["cpu"], "load": False}, "['chunk_size', 'load', 'tiers']"),
        ({"chunk_size": 512, "store": {"save": False}}, "['chunk_size']"),  # not merged
        ({"compact_on": "load", "release": {}}, "['compact_on']"),
        ({"save": False}, "['save']"),
        ({"async_save": False}, "['async_save']"),
        ({"model_id": "m"}, "['model_id']"),
        ({"cpu_capacity_mb": 64}, "['cpu_capacity_mb']"),
        ({"redis_url": "redis://h:1/0"}, "['redis_url']"),
    ],
)
def test_flat_store_keys_are_refused(extra: dict[str, Any], named: str) -> None:
    """Store options at the top level (the old flat spelling) are refused, naming the keys
    and where they go."""
    with pytest.raises(ValueError) as error:
        ConnectorConfig.from_extra(extra)
    assert str(error.value).startswith(f'{named} are store options: give them inside the "store"')
    assert '{"store": {"' in str(error.value)


def test_memory_group_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """The old name of the release group is refused every time, naming the new one (no
    deprecation warning, no alias)."""
    unknown = r'kv_connector_extra_config "memory" is now the "release" group'
    with caplog.at_level(logging.WARNING, logger="connectors.vllm.config"):
        for _ in range(3):
            with pytest.raises(ValueError, match=unknown):
                ConnectorConfig.from_extra(
                    {"policy": "snapkv", "budget": 0.5, "memory": {"decode_budget_tokens": 256}}
                )
    assert caplog.records == []
    with pytest.raises(ValueError, match=unknown):  # not taken beside the new name either
        ConnectorConfig.from_extra({"memory": {}, "release": {}})
    with pytest.raises(ValueError, match=unknown):  # whatever it holds
        ConnectorConfig.from_extra({"memory": 3})
    with pytest.raises(ValueError, match=r"release\.prefill must be one of"):
        ConnectorConfig.from_extra({"release": {"prefill": "sideways"}})


@pytest.mark.parametrize(
    ("policy", "compacts", "mode"),
    [
        ("streaming_llm", True, PrefillMode.BLOCKS),
        ("snapkv", True, PrefillMode.PACK),
        ("none", False, PrefillMode.OFF),
    ],
)
def test_auto_mode(policy: str, compacts: bool, mode: PrefillMode) -> None:
    assert ReleaseOptions().prefill_mode(policy, compacts) is mode


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"prefill": "squeeze"}, "release.prefill"),
        ({"decode_budget_tokens": 0}, "decode_budget_tokens"),
        ({"decode_budget_tokens": True}, "decode_budget_tokens"),
        ({"sink_blocks": 0}, "sink_blocks"),
        ({"min_prompt_tokens": -1}, "min_prompt_tokens"),
        ({"reserve_growth": 1}, "reserve_growth must be true or false"),
        ({"window": 3}, "unknown release option"),
        ({"group": "x"}, "unknown release option"),  # not an option
    ],
)
def test_bad_options_raise(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        release(options)


def test_mode_and_budget_checks_against_engine() -> None:
    with pytest.raises(ValueError, match="compacting policy"):
        ReleaseOptions(prefill="pack").prefill_mode("none", False)
    with pytest.raises(ValueError, match="compacting policy"):  # at parse time, no engine
        ConnectorConfig.from_extra({"policy": "none", "release": {"prefill": "pack"}})
    with pytest.raises(ValueError, match="multiple of the block size"):
        ReleaseOptions(decode_budget_tokens=100).decode_budget_blocks(32)
    assert ReleaseOptions(decode_budget_tokens=128).decode_budget_blocks(32) == 4


def test_cross_group_checks_need_no_engine() -> None:
    implied = ConnectorConfig.from_extra(
        {"policy": "snapkv", "budget": 0.5, "store": {"compact_on": "load"}}
    )
    assert implied.release == ReleaseOptions()  # compact_on "load" turns the group on
    assert implied.release_mode is PrefillMode.PACK
    with pytest.raises(ValueError, match="packs prompts in place only with"):
        ConnectorConfig.from_extra(
            {"policy": "snapkv", "budget": 0.5, "store": {"compact_on": "load"}, "release": False}
        )
    with pytest.raises(ValueError, match=r"release\.prefill must be 'pack', 'blocks' or 'auto'"):
        ConnectorConfig.from_extra(
            {"policy": "snapkv", "store": {"compact_on": "load"}, "release": {"prefill": "off"}}
        )
    with pytest.raises(ValueError, match="does not compute"):
        ConnectorConfig.from_extra({"policy": "kvzip", "release": {"prefill": "pack"}})
    ConnectorConfig.from_extra({"policy": "kvzip", "release": {"prefill": "off"}})


def test_per_head_option() -> None:
    assert ReleaseOptions().per_head_slack() is None
    config = release({"per_head": {"slack": 2}})
    assert config.per_head_slack() == 2.0
    assert release({"per_head": {}}).per_head_slack() == 1.5
    assert config.prefill_mode("adakv", True) is PrefillMode.PACK
    with pytest.raises(ValueError, match="needs prefill mode 'pack'"):
        config.prefill_mode("streaming_llm", True)  # auto picks blocks for streaming_llm
    with pytest.raises(ValueError, match="needs prefill mode 'pack'"):
        release({"per_head": {}, "prefill": "off"}).prefill_mode("adakv", True)


@pytest.mark.parametrize(
    ("per_head", "match"),
    [
        ({"slack": 0.5}, "slack must be a number >= 1"),
        ({"slack": True}, "slack must be a number >= 1"),
        ({"slack": "2"}, "slack must be a number >= 1"),
        ({"pad": 1}, "like"),
        (1.5, "like"),
    ],
)
def test_bad_per_head_raises(per_head: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        release({"per_head": per_head})


def test_config_h2o_options() -> None:
    config = parse(
        ReleaseOptions, {"decode_budget_tokens": 8 * BS, "decode_policy": "h2o"}, "release"
    )
    assert config.decode_recent_blocks(BS) == 4
    assert ReleaseOptions(decode_budget_tokens=8 * BS).decode_recent_blocks(BS) is None
    bad: list[tuple[dict[str, object], str]] = [
        ({"decode_policy": "lru", "decode_budget_tokens": 64}, "decode_policy"),
        ({"decode_policy": "h2o"}, "needs decode_budget_tokens"),
        ({"decode_recent_tokens": 16, "decode_budget_tokens": 64}, "needs decode_policy"),
        (
            {"decode_policy": "h2o", "decode_budget_tokens": 64, "per_head": {"slack": 1.5}},
            "per_head",
        ),
    ]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            parse(ReleaseOptions, options, "release")
    unaligned = ReleaseOptions(
        decode_budget_tokens=8 * BS, decode_policy="h2o", decode_recent_tokens=5
    )
    with pytest.raises(ValueError, match="multiple of the block size"):
        unaligned.decode_recent_blocks(BS)
    no_room = ReleaseOptions(
        decode_budget_tokens=8 * BS, decode_policy="h2o", decode_recent_tokens=7 * BS
    )
    with pytest.raises(ValueError, match="kept region"):
        no_room.decode_recent_blocks(BS)
    with pytest.raises(ValueError, match="prefill mode 'blocks'"):
        ReleaseOptions(decode_budget_tokens=64, decode_policy="h2o").prefill_mode(
            "streaming_llm", True
        )


def test_protect_prompt_rules() -> None:
    """``protect_prompt`` needs a decode budget, and a prefill that leaves the prompt's kept
    blocks before the one hole: ``off``, or ``pack`` with the ``recent`` decode policy."""
    with pytest.raises(ValueError, match="protect_prompt needs decode_budget_tokens"):
        parse(ReleaseOptions, {"protect_prompt": True}, "release")
    recent = ReleaseOptions(decode_budget_tokens=64, protect_prompt=True)
    merging = ReleaseOptions(decode_budget_tokens=64, decode_policy="rkv", protect_prompt=True)
    assert recent.prefill_mode("snapkv", True) is PrefillMode.PACK
    assert merging.prefill_mode("none", False) is PrefillMode.OFF
    with pytest.raises(ValueError, match="protect_prompt with prefill mode 'pack'"):
        merging.prefill_mode("snapkv", True)
    with pytest.raises(ValueError, match="protect_prompt with prefill mode 'blocks'"):
        recent.prefill_mode("streaming_llm", True)


def test_unknown_option_lists_every_allowed_key() -> None:
    """The groups are named among the allowed keys, not only the rule fields."""
    with pytest.raises(
        ValueError, match=r"unknown .*\['sideways'\]; allowed: \[.*'release'.*'store'"
    ):
        ConnectorConfig.from_extra({"sideways": 1})


def test_store_quantize_option_config_and_namespace() -> None:
    """``store.quantize`` is validated, reaches the store config, and gives the store its
    own namespace (whole and compacted chunks alike), leaving unquantized ones unchanged."""
    assert StoreOptions().quantize == "auto" and StoreOptions().store_config().quantize is None
    assert ConnectorConfig.from_extra({"policy": "none"}).store.quantize is None
    assert ConnectorConfig.from_extra({"budget": 0.25}).store.quantize == "int8"
    int8 = ConnectorConfig.from_extra({"store": {"quantize": "int8", "tiers": ["cpu"]}})
    assert int8.store.quantize == "int8" and int8.store.store_config().quantize == "int8"
    allowed = r"store\.quantize must be one of \['auto', 'int8', 'fp8'\]"
    with pytest.raises(ValueError, match=allowed):
        ConnectorConfig.from_extra({"store": {"quantize": "int4"}})
    with pytest.raises(ValueError, match=r"store\.quantize must be one of"):
        ConnectorConfig.from_extra({"store": {"quantize": True}})
    with pytest.raises(ValueError, match=r"\['quantize'\] are store options"):
        ConnectorConfig.from_extra({"quantize": "int8"})
    assert ConnectorConfig.from_extra({"store": {"quantize": None}}).store.quantize is None

    facts = fakes.facts(model_id="m", num_kv_heads=2, head_dim=16)
    for extra in ({"policy": "none"}, {"policy": "snapkv", "budget": 0.5}):
        plain = ConnectorConfig.from_extra(extra)
        digests = {build_namespace(plain, facts).digest()}
        for mode in ("int8", "fp8"):
            quant = ConnectorConfig.from_extra({**extra, "store": {"quantize": mode}})
            assert quant.namespace_params() == {**plain.namespace_params(), "quantize": mode}
            digests.add(build_namespace(quant, facts).digest())
        assert len(digests) == 3  # plain, int8 and fp8 entries never share a key
    assert ConnectorConfig.from_extra({"policy": "none"}).namespace_params() == {"budget": 1.0}
