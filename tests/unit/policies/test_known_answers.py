"""Known answers: constructed inputs where the right plan is known in advance."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmcompact.policies import Budget, CompactionInputs, LayerObservation, make_policy
from lmcompact.policies.adakv import AdaKV
from lmcompact.policies.duoattention import (
    DuoAttention,
    calibrate_head_scores,
    load_head_scores,
    save_head_scores,
)
from lmcompact.policies.fastgen import PROFILES, FastGen
from lmcompact.policies.pyramidkv import PyramidKV
from tests.unit.policies.cases import POLICY_CASES, synthetic_inputs

DOMINANT = 17
ATTENTION_CASES = (
    "h2o", "snapkv", "snapkv-avgpool", "tova", "pyramidkv", "adakv-snapkv", "adakv-h2o",
    "chunkkv",
)  # fmt: skip


def with_dominant_key(inputs: CompactionInputs, index: int) -> CompactionInputs:
    """Make candidate ``index`` take most of every attention row of every head."""
    for layer in inputs.layers:
        assert layer.window_attention is not None and layer.cumulative_scores is not None
        attention = layer.window_attention.clone()
        attention[:, :, index] = 0.0
        attention = attention / attention.sum(-1, keepdim=True) * 0.3
        attention[:, :, index] = 0.7
        layer.window_attention = attention
        layer.window_scores = attention.sum(dim=1)
        layer.cumulative_scores = layer.cumulative_scores + 10.0 * (
            torch.arange(inputs.num_candidates) == index
        )
    return inputs


@pytest.mark.parametrize(
    "case",
    [c for c in POLICY_CASES if c.id in ATTENTION_CASES],
    ids=lambda c: c.id,
)
def test_dominant_key_is_kept(case) -> None:  # type: ignore[no-untyped-def]
    for seed in range(3):
        inputs = with_dominant_key(synthetic_inputs(3, 2, 64, 8, seed=seed), DOMINANT)
        plan = case.make(24, 3, 2).plan(inputs)
        for layer, heads in enumerate(plan.kept):
            for head, kept in enumerate(heads):
                assert DOMINANT in kept.tolist(), (case.id, layer, head)
        # and without the dominance, budgets this small drop most middle tokens
        assert plan.kept_counts().float().mean() < 64


def test_without_dominance_the_key_can_be_dropped() -> None:
    """Control for the test above: the same key is not kept by accident everywhere."""
    dropped = 0
    for seed in range(3):
        inputs = synthetic_inputs(3, 2, 64, 8, seed=seed)
        plan = make_policy("h2o", budget=24).plan(inputs)
        dropped += sum(DOMINANT not in kept.tolist() for heads in plan.kept for kept in heads)
    assert dropped > 0


def test_streaming_llm_keeps_sinks_and_recent_window() -> None:
    inputs = synthetic_inputs(2, 3, 30, 4)
    plan = make_policy("streaming_llm", n_sink=4, budget=10).plan(inputs)
    expected = [0, 1, 2, 3, 24, 25, 26, 27, 28, 29]
    assert all(kept.tolist() == expected for heads in plan.kept for kept in heads)


def test_streaming_llm_on_decode_candidates_uses_original_positions() -> None:
    positions = torch.tensor([[0, 1, 9, 4, 30, 31, 12, 0], [2, 0, 50, 40, 41, 7, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    inputs = CompactionInputs(8, 2, [LayerObservation()], positions=positions, valid=valid)
    plan = make_policy("streaming_llm", n_sink=2, budget=4).plan(inputs)
    # head 0: sinks at slots 0, 1; most recent: positions 31 (slot 5), 30 (slot 4)
    # head 1: sink position 0 at slot 1 (position 2 is not a sink); recent 50, 41, 40
    assert plan.kept[0][0].tolist() == [0, 1, 4, 5]
    assert plan.kept[0][1].tolist() == [1, 2, 3, 4]


def test_h2o_always_keeps_its_recent_window() -> None:
    inputs = synthetic_inputs(1, 2, 40, 4)
    inputs.layers[0].cumulative_scores = torch.zeros(2, 40)
    inputs.layers[0].cumulative_scores[:, 30:] = -1.0  # the recent tokens score worst
    plan = make_policy("h2o", budget=10, recent_ratio=0.5).plan(inputs)
    for kept in plan.kept[0]:
        assert set(range(35, 40)) <= set(kept.tolist())


def test_snapkv_always_keeps_the_observation_window() -> None:
    inputs = synthetic_inputs(1, 2, 40, 4, window=8)
    inputs.layers[0].window_scores = torch.zeros(2, 40)
    inputs.layers[0].window_scores[:, :10] = 1.0
    plan = make_policy("snapkv", budget=12, window_size=8, kernel_size=1).plan(inputs)
    for kept in plan.kept[0]:
        assert kept.tolist() == [6, 7, 8, 9, *range(32, 40)]


def test_tova_ranks_by_last_query_averaged_over_heads() -> None:
    attention = torch.full((2, 3, 10), 0.01)
    attention[0, -1, 2] = 0.9  # head 0's last query likes slot 2
    attention[1, -1, 5] = 0.5  # head 1's last query likes slot 5
    attention[:, :-1, 8] = 5.0  # earlier queries are ignored by TOVA
    inputs = CompactionInputs(10, 2, [LayerObservation(window_attention=attention)])
    plan = make_policy("tova", budget=2).plan(inputs)
    assert plan.kept[0][0].tolist() == plan.kept[0][1].tolist() == [2, 5]


def test_knorm_keeps_the_smallest_norm_keys() -> None:
    generator = torch.Generator().manual_seed(0)
    directions = torch.nn.functional.normalize(torch.randn(2, 12, 8, generator=generator), dim=-1)
    norms = torch.stack([torch.randperm(12, generator=generator) + 1.0 for _ in range(2)])
    inputs = CompactionInputs(12, 2, [LayerObservation(keys=directions * norms[..., None])])
    plan = make_policy("knorm", budget=4).plan(inputs)
    for head in range(2):
        assert plan.kept[0][head].tolist() == sorted(torch.argsort(norms[head])[:4].tolist())


def test_adakv_moves_budget_from_concentrated_to_spread_heads() -> None:
    scores = torch.full((2, 20), 1e-4)
    scores[0, [3, 11]] = 0.5  # head 0: all mass on two tokens
    scores[1] = 1.0 / 20  # head 1: spread evenly
    inputs = CompactionInputs(20, 2, [LayerObservation(window_scores=scores)])
    policy = make_policy(
        "adakv", budget=6, scorer="snapkv", scorer_params={"window_size": 0, "kernel_size": 1}
    )
    assert isinstance(policy, AdaKV)
    plan = policy.plan(inputs)
    # 12 tokens for the layer; head 0 gets its safeguard ceil(0.2 * 6) = 2 = its two peaks
    assert plan.kept_counts().tolist() == [[2, 10]]
    assert plan.kept[0][0].tolist() == [3, 11]


def test_adakv_instance_needs_follow_the_scorer() -> None:
    policy = make_policy("adakv", scorer="knorm")
    inputs = synthetic_inputs(1, 2, 16, 4)
    inputs.layers[0].window_scores = None  # knorm needs keys only
    assert policy.plan(inputs).kept_counts().sum() == 16


def test_pyramidkv_budgets_form_a_pyramid_with_the_mean_budget() -> None:
    inputs = synthetic_inputs(4, 2, 200, 4)
    policy = make_policy("pyramidkv", budget=40, window_size=8, beta=20)
    assert isinstance(policy, PyramidKV)
    budgets = policy.layer_budgets(inputs)
    # m = 32: top = 32 / 20 = 1.6, bottom = 62.4, step 20.27 -> shares 62.4 42.1 21.9 1.6
    assert sum(budgets) == 4 * 40
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 2 * budgets[-1]
    assert [b - 8 for b in budgets] == [62, 42, 22, 2]
    assert (
        PyramidKV(budget=Budget(tokens=40), window_size=8, beta=1).layer_budgets(inputs) == [40] * 4
    )


# ----------------------------------------------------------------- DuoAttention
def test_duoattention_retrieval_heads_keep_everything_streaming_heads_sinks_and_recent() -> None:
    inputs = synthetic_inputs(2, 2, 50, 4)
    policy = make_policy(
        "duoattention",
        sink_size=4,
        recent_size=8,
        head_scores=[[0.9, 0.1], [0.2, 0.8]],
        threshold=0.5,
    )
    plan = policy.plan(inputs)
    streaming = [*range(4), *range(42, 50)]
    assert plan.kept[0][0].tolist() == list(range(50))
    assert plan.kept[1][1].tolist() == list(range(50))
    assert plan.kept[0][1].tolist() == streaming
    assert plan.kept[1][0].tolist() == streaming
    # sparsity instead of a threshold: the lowest 3 of 4 heads stream
    sparse = make_policy(
        "duoattention",
        sink_size=4,
        recent_size=8,
        head_scores=[[0.9, 0.1], [0.2, 0.8]],
        sparsity=0.75,
    )
    assert isinstance(sparse, DuoAttention)
    assert sparse.retrieval_heads(inputs).tolist() == [[True, False], [False, False]]


def test_duoattention_calibration_finds_the_retrieval_head(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t, w = 64, 4
    attention = torch.zeros(2, w, t)
    attention[0, :, 10:30] = 1.0 / 20  # head 0 reads the middle of the prompt
    attention[1, :, :2] = 0.5  # head 1 looks at sinks...
    attention[1, :, -4:] += 0.5 / 4  # ... and recent tokens
    attention[1] /= attention[1].sum(-1, keepdim=True)
    scores = calibrate_head_scores([attention], sink_size=2, recent_size=8)
    assert scores[0, 0] > 0.99 and scores[0, 1] < 1e-6
    inputs = CompactionInputs(t, 2, [LayerObservation(window_attention=attention)])
    plan = make_policy("duoattention", sink_size=2, recent_size=8, sparsity=0.5).plan(inputs)
    assert plan.kept_counts().tolist() == [[64, 10]]
    # the calibrated pattern round-trips through every file format
    for name in ("pattern.json", "pattern.npy"):
        save_head_scores(tmp_path / name, scores)
        assert torch.allclose(load_head_scores(tmp_path / name), scores)
    np.savetxt(tmp_path / "full_attention_heads.tsv", scores.numpy(), delimiter="\t")
    (tmp_path / "plain.json").write_text(json.dumps(scores.tolist()))
    for name in ("full_attention_heads.tsv", "plain.json", "pattern.json"):
        from_file = make_policy(
            "duoattention", sink_size=2, recent_size=8, pattern_path=str(tmp_path / name)
        )
        assert from_file.needs.name == "NOTHING"
        assert from_file.plan(inputs) == plan


# ---------------------------------------------------------------------- FastGen
def fastgen_maps() -> tuple[CompactionInputs, list[str]]:
    """Five heads, each built so that exactly one profile is the cheapest to recover.

    T = 40, special slot 0, punctuation slots 7/15/23, local and frequency sets of
    10 tokens (ratios 0.25); "distant" tokens are slots 2-6 and 9-13.
    """
    t, w = 40, 4
    distant = [2, 3, 4, 5, 6, 9, 10, 11, 12, 13]
    punct = [7, 15, 23]
    local = list(range(30, 40))
    rest = [i for i in range(t) if i not in [0, *punct, *distant, *local]]
    rows = torch.zeros(5, t)
    rows[0, 0] = 0.97  # special suffices
    rows[0, 1:] = 0.03 / 39
    rows[1, 0] = 0.5  # special + punctuation
    rows[1, punct] = 0.16
    rows[1, distant + local + rest] = 0.02 / 37
    rows[2, 0] = 0.03  # frequency needed
    rows[2, distant] = 0.095
    rows[2, punct + local + rest] = 0.02 / 29
    rows[3, distant] = 0.05  # locality needed on top of frequency
    rows[3, local] = 0.048
    rows[3, [0, *punct, *rest]] = 0.02 / 21
    rows[4] = 1.0 / t  # uniform: only full works
    special = torch.zeros(t, dtype=torch.bool)
    special[0] = True
    punctuation = torch.zeros(t, dtype=torch.bool)
    punctuation[punct] = True
    attention = rows[:, None, :].expand(5, w, t).clone()
    inputs = CompactionInputs(
        t,
        5,
        [LayerObservation(window_attention=attention)],
        special_mask=special,
        punctuation_mask=punctuation,
    )
    return inputs, list(PROFILES)


def test_fastgen_picks_the_cheapest_profile_meeting_the_threshold() -> None:
    inputs, expected = fastgen_maps()
    policy = make_policy("fastgen", recovery_threshold=0.95, local_ratio=0.25, frequency_ratio=0.25)
    assert isinstance(policy, FastGen)
    assert policy.choose_profiles(inputs) == [expected]
    plan = policy.plan(inputs)
    assert plan.kept[0][0].tolist() == [0]
    assert plan.kept[0][1].tolist() == [0, 7, 15, 23]
    assert plan.kept[0][2].tolist() == sorted([0, 7, 15, 23, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13])
    assert plan.kept[0][3].tolist() == sorted(
        [0, 7, 15, 23, *range(2, 7), *range(9, 14), *range(30, 40)]
    )
    assert plan.kept[0][4].tolist() == list(range(40))


def test_fastgen_threshold_moves_the_choice() -> None:
    inputs, _ = fastgen_maps()
    lenient = make_policy(
        "fastgen", recovery_threshold=0.45, local_ratio=0.25, frequency_ratio=0.25
    )
    assert isinstance(lenient, FastGen)
    # head 3 recovers ~0.51 with frequency alone; head 1's 0.5 special mass now suffices
    assert lenient.choose_profiles(inputs)[0][:4] == [
        "special",
        "special",
        "special+punct+frequency",
        "special+punct+frequency",
    ]


def test_fastgen_budget_caps_every_head() -> None:
    inputs, _ = fastgen_maps()
    plan = make_policy("fastgen", budget=5, local_ratio=0.25, frequency_ratio=0.25).plan(inputs)
    assert plan.kept_counts().tolist() == [[1, 4, 5, 5, 5]]
    assert 0 in plan.kept[0][4].tolist()  # special tokens go first under the cap
