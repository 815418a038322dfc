"""``store.per_head``: options and the eval flag (the ragged save job and stored-chunk checks:
``tests/unit/compaction/test_save_job.py``; the real engine:
``tests/integration/vllm_release/test_store_per_head.py``)."""

from __future__ import annotations

import pytest

from connectors.vllm.config import ConnectorConfig, load_width
from lmcompact.eval.vllm_cells import VllmEvalConfig, connector_extra, policy_label

RAGGED = {"allocation": "ragged", "share": False, "kernel_size": 1}


def _config(**store: object) -> ConnectorConfig:
    return ConnectorConfig.from_extra(
        {"policy": "kvzip", "policy_params": RAGGED, "budget": 0.25, "store": store}
    )


def test_slots_per_chunk_is_the_layer_cap_and_the_head_cap_the_slack() -> None:
    assert _config(chunk_size=256).slots_per_chunk(32) == 64  # off: K
    assert _config(chunk_size=256).head_cap_per_chunk(32) is None
    # dense cells: a loaded chunk takes K x layer_slack slots (default 1), whatever the slack
    assert _config(chunk_size=256, per_head={"slack": 2}).slots_per_chunk(32) == 64
    assert _config(chunk_size=256, per_head={}).slots_per_chunk(32) == 64
    layered = _config(chunk_size=256, per_head={"slack": 2, "layer_slack": 1.2})
    assert layered.slots_per_chunk(32) == 76  # floor(76.8): a load rounds n x 76 up once
    assert [load_width(n, 76, 32) for n in (1, 2, 8)] == [96, 160, 608]
    # one head keeps at most K x slack of a chunk, in whole blocks
    assert _config(chunk_size=256, per_head={"slack": 2}).head_cap_per_chunk(32) == 128
    assert _config(chunk_size=256, per_head={"slack": 1.2}).head_cap_per_chunk(32) == 96
    assert _config(chunk_size=256, per_head={}).head_cap_per_chunk(32) == 192  # default 3
    # a cap of the whole chunk would leave no hole: C - 1 block
    assert _config(chunk_size=256, per_head={"slack": 8}).head_cap_per_chunk(32) == 224
    whole = _config(chunk_size=256, per_head={"slack": 8, "layer_slack": 8})
    assert whole.slots_per_chunk(32) == 224
    assert _config(chunk_size=256, per_head={"slack": 2}).per_head_counts
    # ragged chunks never share a namespace with uniform ones or other caps'
    spaces = [
        _config(**s).namespace_params()
        for s in ({}, {"per_head": {"slack": 2}}, {"per_head": {"slack": 2, "layer_slack": 1.5}})
    ]
    assert "per_head_slack" not in spaces[0] and spaces[1]["per_head_slack"] == 2.0
    assert spaces[1]["per_head_layer_slack"] == 1.0 and spaces[2]["per_head_layer_slack"] == 1.5


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"policy": "kvzip", "budget": 0.25, "store": {"per_head": {"slack": 0.5}}},
            "slack must be",
        ),
        ({"policy": "kvzip", "budget": 0.25, "store": {"per_head": {"width": 2}}}, "like"),
        (
            {"policy": "kvzip", "budget": 0.25, "store": {"per_head": {"layer_slack": 4}}},
            r"layer_slack must be a number in \[1, slack = 3\]",
        ),
        (
            {
                "policy": "adakv",
                "budget": 0.25,
                "store": False,
                "release": {"prefill": "pack", "per_head": {"slack": 1.5, "layer_slack": 0.9}},
            },
            r"release\.per_head\.layer_slack",
        ),
        ({"policy": "kvzip", "budget": 0.25, "store": {"per_head": 2}}, r"store\.per_head"),
        ({"policy": "none", "store": {"per_head": {"slack": 2}}}, "compacting policy"),
        (
            {
                "policy": "snapkv",
                "budget": 0.25,
                "store": {"compact_on": "load", "per_head": {}},
                "release": {"prefill": "pack"},
            },
            "compact_on 'save'",
        ),
        (
            {
                "policy": "adakv",
                "budget": 0.25,
                "store": {"per_head": {}},
                "release": {"prefill": "pack", "per_head": {}},
            },
            "together",
        ),
        # the old flat spelling names where the option goes
        ({"policy": "kvzip", "budget": 0.25, "per_head": {}}, 'inside the "store" group'),
    ],
)
def test_bad_per_head_options_name_the_problem(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra(extra)


def test_eval_passes_the_slack_to_save_cells_and_labels_them() -> None:
    config = VllmEvalConfig(policies=["kvzip"], per_head_slack=3.0)
    save = connector_extra("save", "kvzip", 0.25, config, "ns")
    assert save["store"]["per_head"] == {"slack": 3.0}
    assert ConnectorConfig.from_extra(save).store.per_head_slack() == 3.0
    assert "per_head" not in connector_extra("inplace", "kvzip", 0.25, config, "ns")["store"]
    assert policy_label("kvzip", config, True, "save") == "kvzip+reconstruct/per_head3"
    with pytest.raises(ValueError, match="per_head_slack"):
        VllmEvalConfig(per_head_slack=0.5)
