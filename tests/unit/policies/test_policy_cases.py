"""Every policy of the shared case list: budgets, plan validity, padding, determinism."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcompact.plan import KeepPlan
from lmcompact.policies import Budget, CompactionInputs, CompactionPolicy, Phase
from lmcompact.policies.adakv import AdaKV
from lmcompact.policies.duoattention import DuoAttention
from lmcompact.policies.pyramidkv import PyramidKV
from tests.unit.policies.cases import BUDGET_RULES, POLICY_CASES, PolicyCase

CASE_IDS = [case.id for case in POLICY_CASES]
BUILTIN_NAMES = {
    "none", "random", "streaming_llm", "h2o", "tova", "snapkv",
    "pyramidkv", "adakv", "knorm", "fastgen", "duoattention", "kvzip", "expected_attention",
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
    assert described["name"] == case.name
    assert set(described["params"]) >= {"budget"}
    assert described["phases"] and set(described["phases"]) <= {"PREFILL", "DECODE"}
    assert "arxiv.org" in (type(policy).__doc__ or "") or case.name in ("none", "random")
    if isinstance(policy, AdaKV):
        # an Ada-KV instance reads and runs when its scorer does, whatever the class says
        assert policy.phases == type(policy.inner).phases
        assert policy.needs == type(policy.inner).needs
        tova = AdaKV(budget=Budget(ratio=0.5), scorer="tova")
        assert Phase.DECODE in tova.phases and Phase.DECODE not in type(tova).phases
