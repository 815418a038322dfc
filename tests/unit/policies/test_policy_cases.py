"""Every policy of the shared case list: budgets, plan validity, padding, determinism."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcompact.plan import KeepPlan
from lmcompact.policies import (
    Budget,
    CompactionInputs,
    CompactionPolicy,
    LayerObservation,
    Need,
    Phase,
)
from lmcompact.policies.adakv import AdaKV
from lmcompact.policies.duoattention import DuoAttention
from lmcompact.policies.pyramidkv import PyramidKV
from tests.unit.policies.cases import BUDGET_RULES, POLICY_CASES, PolicyCase

CASE_IDS = [case.id for case in POLICY_CASES]
BUILTIN_NAMES = {
    "none", "random", "streaming_llm", "h2o", "tova", "snapkv", "decoding_snapkv", "rkv", "chunkkv",
    "pyramidkv", "adakv", "knorm", "fastgen", "duoattention", "kvzip", "expected_attention",
    "self_info",
}  # fmt: skip


def check_plan_shape(plan: KeepPlan, inputs: CompactionInputs) -> None:
    """Valid plan: right shape, per head sorted unique indices in [0, T), valid only."""
    plan.validate_for(inputs.num_layers, inputs.num_kv_heads, inputs.num_candidates)
    valid = inputs.valid_or_all()
    for heads in plan.kept:
        for head, kept in enumerate(heads):
            assert kept.dtype == torch.int64
            if kept.numel():
                assert int(kept.min()) >= 0 and int(kept.max()) < inputs.num_candidates
                assert bool((kept[1:] > kept[:-1]).all()), "indices must be sorted and unique"
                assert bool(valid[head, kept].all()), "an invalid (padding) slot was kept"


def check_budget(
    case: PolicyCase, policy: CompactionPolicy, inputs: CompactionInputs, plan: KeepPlan
) -> None:
    """Assert the case's budget rule (see ``BUDGET_RULES``) on a plan."""
    counts = plan.kept_counts()  # (L, H)
    valid = inputs.valid_counts()  # (H,)
    layers, heads = counts.shape
    rule = case.budget_rule
    if rule == "all":
        assert torch.equal(counts, valid.expand(layers, -1))
        return
    k = policy.keep_count(inputs)
    if rule == "exact":
        assert torch.equal(counts, valid.clamp(max=k).expand(layers, -1))
    elif rule == "cap":
        assert bool((counts <= valid.clamp(max=k)).all())
        assert bool((counts >= 1).all())  # the special token (slot 0) or more
    elif rule == "layer_total":
        assert isinstance(policy, AdaKV)
        assert torch.equal(
            counts.sum(dim=1), torch.full((layers,), min(k * heads, int(valid.sum())))
        )
        floor = valid.clamp(max=math.ceil(policy.alpha_safeguard * k))
        assert bool((counts >= floor).all())
        assert bool((counts <= valid).all())
    elif rule == "pyramid":
        assert isinstance(policy, PyramidKV)
        budgets = torch.tensor(policy.layer_budgets(inputs))
        assert torch.equal(counts, torch.minimum(budgets[:, None], valid[None, :]))
        assert bool((budgets[1:] <= budgets[:-1]).all()), "lower layers must keep more"
        assert int(budgets.sum()) == layers * min(k, int(valid.min()))
    elif rule == "pattern":
        assert isinstance(policy, DuoAttention)
        retrieval = policy.retrieval_heads(inputs)
        positions = inputs.positions_or_arange()
        sinks = ((positions < policy.sink_size) & inputs.valid_or_all()).sum(dim=-1)
        streaming = torch.minimum(valid, sinks + policy.recent_size)
        expected = torch.where(retrieval, valid.expand(layers, -1), streaming.expand(layers, -1))
        assert torch.equal(counts, expected)
    else:  # pragma: no cover - a typo in cases.py
        raise AssertionError(f"unknown budget rule {rule!r}; known: {sorted(BUDGET_RULES)}")


def test_cases_cover_every_builtin_policy() -> None:
    assert {case.name for case in POLICY_CASES} == BUILTIN_NAMES
    assert len(set(CASE_IDS)) == len(CASE_IDS)
    assert all(case.budget_rule in BUDGET_RULES for case in POLICY_CASES)


@pytest.mark.parametrize("padded", [False, True], ids=["prefill", "padded"])
@pytest.mark.parametrize("case", POLICY_CASES, ids=CASE_IDS)
@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_budget_and_plan_validity(case: PolicyCase, padded: bool, data: st.DataObject) -> None:
    layers = data.draw(st.integers(1, 3), label="layers")
    heads = data.draw(st.integers(1, 4), label="heads")
    length = data.draw(st.integers(4, 40), label="T")
    head_dim = data.draw(st.sampled_from([2, 4, 8]), label="D")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    budget: Budget = data.draw(
        st.one_of(
            st.floats(0.05, 1.0).map(lambda r: Budget(ratio=r)),
            st.integers(1, length).map(lambda n: Budget(tokens=n)),
        ),
        label="budget",
    )
    inputs = case.build(layers, heads, length, head_dim, seed=seed, padded=padded)
    policy = case.make(budget, layers, heads)
    plan = policy.plan(inputs)
    check_plan_shape(plan, inputs)
    check_budget(case, policy, inputs, plan)
    assert policy.plan(inputs) == plan, "same inputs must give the same plan"


@pytest.mark.parametrize("budget", [0.25, "0.25", 6, "6", Budget(tokens=6), Budget(ratio=1.0)])
@pytest.mark.parametrize("case", POLICY_CASES, ids=CASE_IDS)
def test_budget_as_ratio_and_as_tokens(case: PolicyCase, budget: Budget | float | str) -> None:
    inputs = case.build(2, 3, 24, 8, seed=3)
    policy = case.make(budget, 2, 3)
    assert policy.budget == Budget.parse(budget)
    plan = policy.plan(inputs)
    check_plan_shape(plan, inputs)
    check_budget(case, policy, inputs, plan)
    if case.budget_rule == "exact":
        expected = 6 if Budget.parse(budget).tokens else Budget.parse(budget).resolve(24)
        assert bool((plan.kept_counts() == expected).all())


@pytest.mark.parametrize("case", POLICY_CASES, ids=CASE_IDS)
def test_decode_candidates_never_keep_padding(case: PolicyCase) -> None:
    """Padding slots carry the most attractive values; no policy may keep one."""
    policy = case.make(0.5, 2, 4)
    for seed in range(3):
        inputs = case.build(2, 4, 32, 8, seed=seed, padded=True)
        assert inputs.valid is not None and not bool(inputs.valid.all())
        plan = policy.plan(inputs)
        assert not bool((plan.masks() & ~inputs.valid).any())
        check_budget(case, policy, inputs, plan)


@pytest.mark.parametrize(
    "case", [c for c in POLICY_CASES if c.budget_rule == "exact"], ids=lambda c: c.id
)
def test_budget_tokens_override(case: PolicyCase) -> None:
    """Decode-time callers pass ``budget_tokens``; it replaces the policy's budget."""
    inputs = case.build(2, 2, 20, 4, seed=5)
    inputs.budget_tokens = 3
    assert bool((case.make(0.9).plan(inputs).kept_counts() == 3).all())


@pytest.mark.parametrize("case", POLICY_CASES, ids=CASE_IDS)
def test_describe_is_plain_data(case: PolicyCase) -> None:
    policy = case.make(0.5, 2, 2)
    described = type(policy).describe()
    assert json.loads(json.dumps(described)) == described, "describe() must be plain data"
    assert described["name"] == case.name
    assert set(described["params"]) >= {"budget"}
    assert described["phases"], "a policy applies at some phase"
    assert "arxiv.org" in (type(policy).__doc__ or "") or case.name in ("none", "random")


_NEEDED_BY = {
    Need.KEYS: ("keys", "values"),
    Need.WINDOW_SCORES: ("window_scores",),
    Need.WINDOW_ATTENTION: ("window_attention",),
    Need.CUMULATIVE_SCORES: ("cumulative_scores",),
    Need.CONTEXT_SCORES: ("context_scores",),
    Need.WINDOW_QUERIES: ("window_queries",),
}


def only_declared(inputs: CompactionInputs, needs: Need) -> CompactionInputs:
    """``inputs`` without what ``needs`` does not ask for (as the integrations build them)."""
    kept = {attr for flag, attrs in _NEEDED_BY.items() if flag in needs for attr in attrs}
    layers = [
        LayerObservation(**{a: getattr(layer, a) if a in kept else None for a in _LAYER_FIELDS})
        for layer in inputs.layers
    ]
    classes = Need.TOKEN_CLASSES in needs
    return dataclasses.replace(
        inputs,
        layers=layers,
        special_mask=inputs.special_mask if classes else None,
        punctuation_mask=inputs.punctuation_mask if classes else None,
        query_positions=inputs.query_positions if Need.WINDOW_QUERIES in needs else None,
    )


_LAYER_FIELDS = [f.name for f in dataclasses.fields(LayerObservation)]


@pytest.mark.parametrize("padded", [False, True], ids=["prefill", "padded"])
@pytest.mark.parametrize("case", POLICY_CASES, ids=CASE_IDS)
def test_an_instance_reads_only_what_it_declares(case: PolicyCase, padded: bool) -> None:
    """The instance's ``needs`` (what every integration computes for it) are enough: the
    plan from just those inputs is the plan from all of them, and a missing one is a
    ValueError naming it. Read from the instance, as the integrations do (an Ada-KV
    instance declares its scorer's needs)."""
    policy = case.make(0.5, 2, 3)
    full = case.build(2, 3, 24, 8, seed=11, padded=padded)
    assert policy.plan(only_declared(full, policy.needs)) == policy.plan(full)
    for flag, attrs in _NEEDED_BY.items():
        if flag in policy.needs:
            missing = only_declared(full, policy.needs & ~flag)
            with pytest.raises(ValueError, match=attrs[0]):
                policy.plan(missing)


def decode_step_inputs(full: CompactionInputs, target: int) -> CompactionInputs:
    """What the decode path (``lmcompact.hf.cache``) hands a policy: one layer of padded
    candidates, the last step's attention as a one-query window, cumulative scores, a
    fixed ``budget_tokens``; no token classes, context scores or window queries."""
    layer = full.layers[0]
    assert layer.window_scores is not None
    return dataclasses.replace(
        full,
        layers=[
            LayerObservation(
                keys=layer.keys,
                values=layer.values,
                window_scores=layer.window_scores,
                window_attention=layer.window_scores[:, None, :],
                cumulative_scores=layer.cumulative_scores,
            )
        ],
        special_mask=None,
        punctuation_mask=None,
        query_positions=None,
        budget_tokens=target,
    )


@pytest.mark.parametrize("case", POLICY_CASES, ids=CASE_IDS)
def test_phases_of_an_instance_hold(case: PolicyCase) -> None:
    """``Phase.DECODE in policy.phases`` (instance, as ``lmcompact.hf.cache`` reads it)
    promises a policy that plans decode-time inputs and keeps to their ``budget_tokens``;
    one that does not declare it must declare PREFILL. No policy is exempted: a DECODE
    policy that needed token classes, context scores or window queries, ignored
    ``budget_tokens`` or kept padding fails here."""
    policy = case.make(0.5, 1, 3)
    assert policy.phases & Phase.BOTH, "a policy applies at some phase"
    if Phase.DECODE not in policy.phases:
        return
    for seed in range(3):
        decode = decode_step_inputs(case.build(1, 3, 24, 8, seed=seed, padded=True), target=5)
        inputs = only_declared(decode, policy.needs)
        plan = policy.plan(inputs)
        check_plan_shape(plan, inputs)
        check_budget(case, policy, inputs, plan)
        assert policy.keep_count(inputs) == 5


@pytest.mark.parametrize("scorer", ["snapkv", "knorm", "h2o", "tova", "streaming_llm"])
def test_adakv_instance_runs_when_its_scorer_does(scorer: str) -> None:
    """Ada-KV's class says PREFILL and WINDOW_SCORES (its default scorer); an instance
    declares its scorer's phases and needs, so Ada-KV over a decode scorer compacts
    during decode (``test_phases_of_an_instance_hold`` then holds it to that)."""
    policy = AdaKV(budget=Budget(ratio=0.5), scorer=scorer)
    inner = type(policy.inner)
    assert (policy.phases, policy.needs) == (inner.phases, inner.needs)
    if Phase.DECODE in inner.phases:
        decode = decode_step_inputs(POLICY_CASES[0].build(1, 2, 16, 4, padded=True), target=3)
        plan = policy.plan(only_declared(decode, policy.needs))
        assert int(plan.kept_counts().sum()) == min(3 * 2, int(decode.valid_counts().sum()))
