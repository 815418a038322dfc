"""Bad input raises ValueError saying what was wrong and what is allowed."""

from __future__ import annotations

import pytest
import torch

from lmcompact.policies import CompactionInputs, LayerObservation, get_policy_class, make_policy
from tests.unit.policies.cases import POLICY_CASES, synthetic_inputs


def test_unknown_policy_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'snapk'; available: .*snapkv"):
        get_policy_class("snapk")
    with pytest.raises(ValueError, match=r"unknown policy 'nope'"):
        make_policy("nope")


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (0, r"budget tokens must be > 0, got 0"),
        (-4, r"budget tokens must be > 0, got -4"),
        (0.0, r"budget ratio must be in \(0, 1\], got 0.0"),
        (1.5, r"budget ratio must be in \(0, 1\], got 1.5"),
        ("lots", r"budget must be a ratio in \(0, 1\] or a token count, got 'lots'"),
    ],
)
@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: c.id)
def test_bad_budget_is_rejected_at_construction(case, budget, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        case.make(budget, 2, 2)


@pytest.mark.parametrize(
    "case", [c for c in POLICY_CASES if c.budget_rule != "all"], ids=lambda c: c.id
)
def test_budget_longer_than_the_sequence(case) -> None:  # type: ignore[no-untyped-def]
    inputs = case.build(2, 2, 20, 4)
    policy = case.make(21, 2, 2)
    if case.name == "duoattention":  # budget not used: documented, no error
        policy.plan(inputs)
        return
    with pytest.raises(ValueError, match=r"exceeds the sequence length 20; allowed: 1\.\.20"):
        policy.plan(inputs)


def test_budget_tokens_override_must_be_positive() -> None:
    inputs = synthetic_inputs(1, 2, 10, 4)
    inputs.budget_tokens = 0
    with pytest.raises(ValueError, match="budget_tokens override must be > 0, got 0"):
        make_policy("knorm").plan(inputs)


@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: c.id)
def test_shape_mismatch_between_keys_and_scores(case) -> None:  # type: ignore[no-untyped-def]
    inputs = case.build(2, 2, 16, 4)
    inputs.layers[1].window_scores = torch.rand(2, 15)  # one candidate short
    with pytest.raises(
        ValueError,
        match=r"layer 1 window_scores has shape \(2, 15\); expected \(kv_heads, T\) "
        r"with kv_heads=2 and T=16",
    ):
        case.make(0.5, 2, 2).plan(inputs)


@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("keys", torch.rand(3, 16, 4), r"layer 0 keys has shape \(3, 16, 4\)"),
        ("keys", torch.rand(2, 16), r"expected \(kv_heads, T, head_dim\)"),
        ("cumulative_scores", torch.rand(2, 17), r"cumulative_scores has shape \(2, 17\)"),
        ("window_attention", torch.rand(2, 16, 4), r"window_attention has shape \(2, 16, 4\)"),
        ("values", torch.rand(2, 16, 3), r"keys \(2, 16, 4\) and values \(2, 16, 3\) differ"),
    ],
)
def test_tensor_shapes_are_checked_for_every_policy(attribute, value, message) -> None:  # type: ignore[no-untyped-def]
    for case in POLICY_CASES:
        inputs = case.build(1, 2, 16, 4)
        setattr(inputs.layers[0], attribute, value)
        with pytest.raises(ValueError, match=message):
            case.make(0.5, 1, 2).plan(inputs)


@pytest.mark.parametrize(
    ("name", "params", "drop", "message"),
    [
        (
            "h2o",
            {},
            "cumulative_scores",
            r"policy 'h2o' needs cumulative_scores but layer 0 "
            r"has none; this policy reads: CUMULATIVE_SCORES",
        ),
        ("knorm", {}, "keys", r"policy 'knorm' needs keys"),
        ("snapkv", {}, "window_scores", r"policy 'snapkv' needs window_scores"),
        ("pyramidkv", {}, "window_scores", r"policy 'pyramidkv' needs window_scores"),
        ("adakv", {}, "window_scores", r"policy 'snapkv' needs window_scores"),
        ("adakv", {"scorer": "h2o"}, "cumulative_scores", r"'h2o' needs cumulative_scores"),
        ("fastgen", {}, "window_attention", r"policy 'fastgen' needs window_attention"),
        ("duoattention", {}, "window_attention", r"'duoattention' needs window_attention"),
    ],
)
def test_missing_needed_input(name, params, drop, message) -> None:  # type: ignore[no-untyped-def]
    inputs = synthetic_inputs(2, 2, 16, 4)
    setattr(inputs.layers[0], drop, None)
    with pytest.raises(ValueError, match=message):
        make_policy(name, **params).plan(inputs)


def test_missing_token_classes_and_tova_inputs() -> None:
    inputs = synthetic_inputs(1, 2, 16, 4)
    inputs.punctuation_mask = None
    with pytest.raises(ValueError, match=r"'fastgen' needs punctuation_mask \(a \(16,\) bool"):
        make_policy("fastgen").plan(inputs)
    bare = CompactionInputs(16, 2, [LayerObservation(keys=torch.rand(2, 16, 4))])
    with pytest.raises(ValueError, match=r"'tova' needs window_attention .* or window_scores"):
        make_policy("tova").plan(bare)


def test_structure_of_inputs() -> None:
    policy = make_policy("streaming_llm")
    with pytest.raises(ValueError, match="inputs have no layers"):
        policy.plan(CompactionInputs(8, 2, []))
    with pytest.raises(ValueError, match=r"valid has shape \(2, 7\), expected \(2, 8\)"):
        policy.plan(CompactionInputs(8, 2, [LayerObservation()], valid=torch.ones(2, 7).bool()))
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        policy.plan(CompactionInputs(8, 2, [LayerObservation()], valid=torch.ones(2, 8)))
    with pytest.raises(ValueError, match=r"positions has shape \(8,\), expected \(2, 8\)"):
        policy.plan(CompactionInputs(8, 2, [LayerObservation()], positions=torch.arange(8)))
    with pytest.raises(ValueError, match=r"special_mask must be a bool tensor of shape \(8,\)"):
        policy.plan(CompactionInputs(8, 2, [LayerObservation()], special_mask=torch.zeros(8)))


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("h2o", {"bogus": 1}, r"bad parameters for policy 'h2o'.*allowed: budget, recent_ratio"),
        ("h2o", {"recent_ratio": 1.5}, r"recent_ratio must be in \[0, 1\], got 1.5"),
        ("streaming_llm", {"n_sink": -1}, r"n_sink must be >= 0, got -1"),
        ("snapkv", {"kernel_size": 4}, r"kernel_size must be an odd integer >= 1, got 4"),
        ("snapkv", {"pooling": "median"}, r"pooling must be one of \('maxpool', 'avgpool'\)"),
        ("pyramidkv", {"beta": 0.5}, r"beta must be >= 1"),
        ("adakv", {"scorer": "fastgen"}, r"adakv needs a score-based scorer .* 'fastgen' is not"),
        ("adakv", {"scorer": "nope"}, r"unknown policy 'nope'"),
        ("adakv", {"scorer_params": {"x": 1}}, r"bad scorer_params for 'snapkv'"),
        ("adakv", {"alpha_safeguard": 2.0}, r"alpha_safeguard must be in \[0, 1\]"),
        ("fastgen", {"recovery_threshold": 0.0}, r"recovery_threshold must be in \(0, 1\]"),
        ("fastgen", {"local_ratio": -0.1}, r"local_ratio must be in \[0, 1\]"),
        ("duoattention", {"sparsity": 1.2}, r"sparsity must be in \[0, 1\], got 1.2"),
        ("duoattention", {"head_scores": [[1.0]], "pattern_path": "x.json"}, r"not both"),
        ("duoattention", {"pattern_path": "/nonexistent/p.json"}, r"does not exist"),
        ("duoattention", {"head_scores": [1.0, 2.0]}, r"must be 2-D \(layers, kv_heads\)"),
    ],
)
def test_bad_hyper_parameters(name, params, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make_policy(name, **params)


def test_duoattention_pattern_for_another_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    policy = make_policy("duoattention", head_scores=[[0.1, 0.9, 0.5]])
    with pytest.raises(ValueError, match=r"pattern has shape \(1, 3\), the inputs have 2 layers"):
        policy.plan(synthetic_inputs(2, 2, 16, 4))
    bad = tmp_path / "pattern.yaml"
    bad.write_text("[]")
    with pytest.raises(ValueError, match=r"allowed: \.json, \.npy, \.tsv, \.csv, \.txt"):
        make_policy("duoattention", pattern_path=str(bad))


def test_nan_scores_are_rejected() -> None:
    inputs = synthetic_inputs(1, 2, 16, 4)
    assert inputs.layers[0].cumulative_scores is not None
    inputs.layers[0].cumulative_scores[1, 3] = float("nan")
    with pytest.raises(ValueError, match="scores contain NaN"):
        make_policy("h2o", budget=4).plan(inputs)
