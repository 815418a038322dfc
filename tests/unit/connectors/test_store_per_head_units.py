"""``store.per_head``: options, the ragged save job, stored-chunk checks and the eval flag
(engine-free; the real engine: ``tests/integration/vllm_memory/test_store_per_head.py``)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.eval.vllm_cells import VllmEvalConfig, connector_extra, policy_label
from lmcompact.policies import make_policy
from lmcompact.vllm.chunks import chunk_problem
from lmcompact.vllm.compaction import compact_job
from lmcompact.vllm.config import ConnectorConfig
from tests.unit.connectors.test_query_agnostic_save import CHUNK, LAYERS, NEEDLE, _job

RAGGED = {"allocation": "ragged", "share": False, "kernel_size": 1}


def _config(**store: object) -> ConnectorConfig:
    return ConnectorConfig.from_extra(
        {"policy": "kvzip", "policy_params": RAGGED, "budget": 0.25, "store": store}
    )


def test_slots_per_chunk_is_the_cap_in_whole_blocks_below_the_chunk() -> None:
    assert _config(chunk_size=256).slots_per_chunk(32) == 64  # off: K
    assert _config(chunk_size=256, per_head={"slack": 2}).slots_per_chunk(32) == 128
    assert _config(chunk_size=256, per_head={"slack": 1.2}).slots_per_chunk(32) == 96
    assert _config(chunk_size=256, per_head={}).slots_per_chunk(32) == 192  # default 3
    # a cap of the whole chunk would leave no hole (nothing masks the padding): C - 1 block
    assert _config(chunk_size=256, per_head={"slack": 8}).slots_per_chunk(32) == 224
    assert _config(chunk_size=256, per_head={"slack": 2}).per_head_counts
    # ragged chunks never share a namespace with uniform ones or another cap's
    spaces = [_config(**s).namespace_params() for s in ({}, {"per_head": {"slack": 2}})]
    assert "per_head_slack" not in spaces[0] and spaces[1]["per_head_slack"] == 2.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"policy": "kvzip", "budget": 0.25, "per_head": {"slack": 0.5}}, "slack must be"),
        ({"policy": "kvzip", "budget": 0.25, "per_head": {"width": 2}}, "like"),
        ({"policy": "kvzip", "budget": 0.25, "per_head": 2}, "per_head"),
        ({"policy": "none", "per_head": {"slack": 2}}, "compacting policy"),
        (
            {
                "policy": "snapkv",
                "budget": 0.25,
                "compact_on": "load",
                "per_head": {},
                "memory": {"prefill": "pack"},
            },
            "compact_on 'save'",
        ),
        (
            {
                "policy": "adakv",
                "budget": 0.25,
                "per_head": {},
                "memory": {"prefill": "pack", "per_head": {}},
            },
            "together",
        ),
    ],
)
def test_bad_per_head_options_name_the_problem(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra(extra)


def test_ragged_job_keeps_per_head_counts_within_the_cap_and_the_budget_on_average() -> None:
    policy = make_policy("kvzip", budget=0.25, n_sink=2, window=8, max_queries=64, **RAGGED)
    positions = policy.context_queries(192)
    assert positions is not None
    generator = torch.Generator().manual_seed(1)
    queries = [torch.randn(positions.numel(), 4, 16, generator=generator) for _ in range(LAYERS)]
    for q in queries:  # head 0's queries (group of kv head 0) read the needle hard
        q[:, :2] = torch.nn.functional.normalize(torch.ones(16), dim=0) * 40.0
    job, layout, _ = _job(queries, positions, window=8)
    uniform = compact_job(job, layout, policy, CHUNK, 16)
    ragged = compact_job(job, layout, policy, CHUNK, 16, cap=32)
    assert all(chunk.uniform_count() == 16 for _, chunk in uniform)  # no cap: K everywhere
    spread = False
    for c, (_, chunk) in enumerate(ragged):
        counts = chunk.kept_counts
        assert int(counts.sum()) == counts.numel() * 16 and int(counts.max()) <= 32
        spread |= counts.unique().numel() > 1
        assert chunk_problem(chunk, _Facts(), CHUNK, 16, cap=32) is None
        assert chunk_problem(chunk, _Facts(), CHUNK, 16, cap=8) is not None  # over a cap
        if c == 1:
            assert all(NEEDLE - CHUNK in chunk.head(0, h)[2].tolist() for h in range(2))
    assert spread, "the ragged allocation gave every (layer, head) the same count"
    # a uniform loader refuses ragged chunks (and a ragged loader takes uniform ones)
    ragged_chunk = next(chunk for _, chunk in ragged if chunk.uniform_count() is None)
    assert chunk_problem(ragged_chunk, _Facts(), CHUNK, 16) is not None
    assert chunk_problem(uniform[0][1], _Facts(), CHUNK, 16, cap=32) is None


class _Facts:
    num_layers = LAYERS
    num_kv_heads = 2
    head_dim = 16
    dtype = torch.float32


def test_eval_passes_the_slack_to_save_cells_and_labels_them() -> None:
    config = VllmEvalConfig(policies=["kvzip"], per_head_slack=3.0)
    assert connector_extra("save", "kvzip", 0.25, config, "ns")["per_head"] == {"slack": 3.0}
    assert "per_head" not in connector_extra("inplace", "kvzip", 0.25, config, "ns")
    assert policy_label("kvzip", config, True, "save") == "kvzip+reconstruct/per_head3"
    with pytest.raises(ValueError, match="per_head_slack"):
        VllmEvalConfig(per_head_slack=0.5)
