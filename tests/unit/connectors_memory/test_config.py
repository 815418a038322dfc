"""The ``release`` option group: parsing, validation, the prefill mode chosen per policy, and
its old spellings (``"memory"``, ``LMCompactMemoryConnector``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from lmcompact.vllm.config import ConnectorConfig, StoreOptions
from lmcompact.vllm.memory.config import ReleaseOptions
from lmcompact.vllm.memory.planner import PrefillMode
from lmcompact.vllm.options import parse


def release(options: dict[str, Any] | None, group: str = "release") -> ReleaseOptions:
    return parse(ReleaseOptions, options, group, prefix=f"{group}.", group=group)


def test_groups_are_parsed_into_one_config() -> None:
    config = ConnectorConfig.from_extra(
        {
            "policy": "snapkv",
            "budget": 0.5,
            "store": {"chunk_size": 512, "tiers": "cpu", "save": False},
            "release": {"decode_budget_tokens": 256},
        }
    )
    assert config.store == StoreOptions(chunk_size=512, save=False)
    assert config.release is not None and config.release.decode_budget_tokens == 256
    assert config.release_mode is PrefillMode.PACK
    assert ConnectorConfig.from_extra({"policy": "none"}).release is None  # off unless given
    assert ConnectorConfig.from_extra({}, release=True).release == ReleaseOptions()
    assert ConnectorConfig.from_extra({"release": True}).release == ReleaseOptions()
    assert ConnectorConfig.from_extra({"release": False}, release=True).release is None


def test_store_group_or_flat_keys_and_store_off() -> None:
    flat = ConnectorConfig.from_extra({"chunk_size": 512, "tiers": ["cpu"], "load": False})
    grouped = ConnectorConfig.from_extra({"store": {"chunk_size": 512, "load": False}})
    assert flat == grouped and flat.store.chunk_size == 512
    off = ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.25, "store": False})
    assert not off.store.enabled and off.store.chunk_size == 256
    with pytest.raises(ValueError, match=r"\['chunk_size'\] given both"):
        ConnectorConfig.from_extra({"chunk_size": 512, "store": {"save": False}})
    with pytest.raises(ValueError, match=r"store\.chunk_size must be a positive int"):
        ConnectorConfig.from_extra({"store": {"chunk_size": 0}})
    with pytest.raises(ValueError, match="unknown store option"):
        ConnectorConfig.from_extra({"store": {"prefill": "pack"}})
    with pytest.raises(ValueError, match="store must be an object, true or false"):
        ConnectorConfig.from_extra({"store": "cpu"})


def test_memory_is_the_old_name_of_release(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcompact.vllm.config"):
        old = ConnectorConfig.from_extra(
            {"policy": "snapkv", "budget": 0.5, "memory": {"decode_budget_tokens": 256}}
        )
    new = ConnectorConfig.from_extra(
        {"policy": "snapkv", "budget": 0.5, "release": {"decode_budget_tokens": 256}}
    )
    assert old == new  # the group name is not part of the options' identity
    assert old.release is not None and old.release.group == "memory"
    with pytest.raises(ValueError, match="not both"):
        ConnectorConfig.from_extra({"memory": {}, "release": {}})
    with pytest.raises(ValueError, match=r"memory\.prefill must be one of"):  # as written
        ConnectorConfig.from_extra({"memory": {"prefill": "sideways"}})
    with pytest.raises(ValueError, match=r"release\.prefill must be one of"):
        ConnectorConfig.from_extra({"release": {"prefill": "sideways"}})
    with pytest.raises(ValueError, match="memory must be an object"):
        ConnectorConfig.from_extra({"memory": 3})


def test_deprecation_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    from lmcompact.vllm.config import _log_deprecated

    _log_deprecated.cache_clear()
    with caplog.at_level(logging.WARNING, logger="lmcompact.vllm.config"):
        for _ in range(3):
            ConnectorConfig.from_extra({"memory": {}})
    lines = [r for r in caplog.records if "old name" in r.getMessage()]
    assert len(lines) == 1


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
    with pytest.raises(ValueError, match="packs prompts in place only with"):
        ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.5, "compact_on": "load"})
    with pytest.raises(ValueError, match=r"memory\.prefill must be 'pack', 'blocks' or 'auto'"):
        ConnectorConfig.from_extra(
            {"policy": "snapkv", "compact_on": "load", "memory": {"prefill": "off"}}
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
