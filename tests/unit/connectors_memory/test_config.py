"""MemoryConfig: parsing, validation, and the prefill mode chosen per policy."""

from __future__ import annotations

import pytest

from connectors.memory.config import MemoryConfig, split_extra
from connectors.memory.planner import PrefillMode


def test_split_extra_separates_memory_options() -> None:
    base, memory = split_extra(
        {"policy": "snapkv", "budget": 0.5, "memory": {"decode_budget_tokens": 256}}
    )
    assert base == {"policy": "snapkv", "budget": 0.5}
    assert memory.decode_budget_tokens == 256 and memory.prefill == "auto"
    assert split_extra({"policy": "none"})[1] == MemoryConfig()


@pytest.mark.parametrize(
    ("policy", "compacts", "mode"),
    [
        ("streaming_llm", True, PrefillMode.BLOCKS),
        ("snapkv", True, PrefillMode.PACK),
        ("none", False, PrefillMode.OFF),
    ],
)
def test_auto_mode(policy: str, compacts: bool, mode: PrefillMode) -> None:
    assert MemoryConfig().prefill_mode(policy, compacts) is mode


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"prefill": "squeeze"}, "memory.prefill"),
        ({"decode_budget_tokens": 0}, "decode_budget_tokens"),
        ({"decode_budget_tokens": True}, "decode_budget_tokens"),
        ({"sink_blocks": 0}, "sink_blocks"),
        ({"min_prompt_tokens": -1}, "min_prompt_tokens"),
        ({"window": 3}, "unknown memory option"),
    ],
)
def test_bad_options_raise(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MemoryConfig.from_extra(options)


def test_mode_and_budget_checks_against_engine() -> None:
    with pytest.raises(ValueError, match="compacting policy"):
        MemoryConfig(prefill="pack").prefill_mode("none", False)
    with pytest.raises(ValueError, match="multiple of the block size"):
        MemoryConfig(decode_budget_tokens=100).decode_budget_blocks(32)
    assert MemoryConfig(decode_budget_tokens=128).decode_budget_blocks(32) == 4
    with pytest.raises(ValueError, match="must be an object"):
        split_extra({"memory": 3})


def test_per_head_option() -> None:
    assert MemoryConfig().per_head_slack() is None
    config = MemoryConfig.from_extra({"per_head": {"slack": 2}})
    assert config.per_head_slack() == 2.0
    assert MemoryConfig.from_extra({"per_head": {}}).per_head_slack() == 1.5
    assert config.prefill_mode("adakv", True) is PrefillMode.PACK
    with pytest.raises(ValueError, match="needs prefill mode 'pack'"):
        config.prefill_mode("streaming_llm", True)  # auto picks blocks for streaming_llm
    with pytest.raises(ValueError, match="needs prefill mode 'pack'"):
        MemoryConfig.from_extra({"per_head": {}, "prefill": "off"}).prefill_mode("adakv", True)


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
        MemoryConfig.from_extra({"per_head": per_head})
