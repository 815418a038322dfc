"""Global top-k projected onto one count per (layer, head) (kvzip ``allocation="global"``)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.policies import CompactionInputs, LayerObservation, make_policy
from lmcompact.policies.allocation import global_keep_mask, rank_fraction
from lmcompact.policies.base import ScorePolicy


def _kept(mask: torch.Tensor, layer: int, head: int) -> list[int]:
    return torch.nonzero(mask[layer, head]).flatten().tolist()


def _two_busy_heads_and_an_idle_one() -> torch.Tensor:
    """``(1, 3, 12)``: heads 0 and 1 score tokens {3, 4, 5} / {4, 5, 6} far above
    anything of head 2, whose own favourites are tokens 9 and 10."""
    scores = torch.full((1, 3, 12), 0.01, dtype=torch.float64)
    scores[0, 0, [3, 4, 5]] = torch.tensor([10.0, 12.0, 11.0], dtype=torch.float64)
    scores[0, 1, [4, 5, 6]] = torch.tensor([13.0, 10.0, 14.0], dtype=torch.float64)
    scores[0, 2, [9, 10]] = torch.tensor([0.5, 0.6], dtype=torch.float64)
    return scores


def test_busy_heads_keep_their_own_best_and_idle_heads_what_most_heads_chose() -> None:
    scores = _two_busy_heads_and_an_idle_one()
    mask = global_keep_mask(scores, 2)
    assert mask.sum(dim=-1).tolist() == [[2, 2, 2]]
    assert _kept(mask, 0, 0) == [4, 5]  # chose 3 tokens, keeps its best 2
    assert _kept(mask, 0, 1) == [4, 6]
    # head 2 chose nothing globally: tokens 4 and 5 have two votes each, its own
    # favourites (9, 10) have none
    assert _kept(mask, 0, 2) == [4, 5]
    # per-head top-k (the "head" allocation) would keep head 2's own favourites
    own = torch.topk(scores[0, 2], 2).indices.sort().values.tolist()
    assert own == [9, 10]


def test_share_gives_every_head_the_most_voted_tokens() -> None:
    mask = global_keep_mask(_two_busy_heads_and_an_idle_one(), 2, share=True)
    for head in range(3):
        assert _kept(mask, 0, head) == [4, 5]


def test_global_choice_spans_layers() -> None:
    """A layer whose scores are all below the other layer's gets no global picks; its
    heads fill with the other layer's choices."""
    scores = torch.zeros(2, 1, 8, dtype=torch.float64)
    scores[0, 0] = torch.tensor([5.0, 6.0, 7.0, 8.0, 9.0, 1.0, 1.0, 1.0])
    scores[1, 0] = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.3, 0.2, 0.4])
    mask = global_keep_mask(scores, 2)
    assert _kept(mask, 0, 0) == [3, 4]
    # layer 1's own best would be 5 and 7; the global top 4 all sit in layer 0 at 1..4,
    # so layer 1 takes the voted tokens 3, 4 (ties broken by its own rank)
    assert _kept(mask, 1, 0) == [3, 4]


def test_forced_keeps_and_padding() -> None:
    scores = torch.rand(2, 2, 10, generator=torch.Generator().manual_seed(0)).double()
    scores[:, :, 0] = float("inf")  # a sink
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 7:] = False
    scores[:, 1, 7:] = 100.0  # padding scored high is still never kept
    mask = global_keep_mask(scores, 3, valid)
    assert bool(mask[:, :, 0].all())
    assert not bool(mask[:, 1, 7:].any())
    assert mask.sum(dim=-1).tolist() == [[3, 3], [3, 3]]
    short = global_keep_mask(scores, 9, valid)
    assert short.sum(dim=-1).tolist() == [[9, 7], [9, 7]]


def test_rank_fraction_orders_each_row() -> None:
    rank = rank_fraction(torch.tensor([[0.2, 0.9, 0.5, 0.9]]))
    # best first, ties to the later candidate
    assert rank.tolist() == [[0.25, 0.75, 0.5, 1.0]]


@pytest.mark.parametrize(
    ("scores", "keep", "message"),
    [
        (torch.zeros(3, 4), 1, r"scores must be \(layers, heads, T\)"),
        (torch.zeros(1, 2, 4), 0, r"keep must be >= 1, got 0"),
    ],
)
def test_bad_arguments(scores: torch.Tensor, keep: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        global_keep_mask(scores, keep)


def test_kvzip_global_allocation_plans_through_the_mask() -> None:
    scores = _two_busy_heads_and_an_idle_one()[0].float()
    inputs = CompactionInputs(12, 3, [LayerObservation(context_scores=scores)])
    params = {"budget": 2, "n_sink": 0, "kernel_size": 1}
    plan = make_policy("kvzip", allocation="global", **params).plan(inputs)
    assert [p.tolist() for p in plan.kept[0]] == [[4, 5], [4, 6], [4, 5]]
    per_head = make_policy("kvzip", **params).plan(inputs)
    assert per_head.kept[0][2].tolist() == [9, 10]
    shared = make_policy("kvzip", allocation="global", share=True, **params).plan(inputs)
    assert [p.tolist() for p in shared.kept[0]] == [[4, 5]] * 3
    with pytest.raises(ValueError, match=r"one of head, global, ragged, got 'x'"):
        make_policy("kvzip", allocation="x")


def test_expected_attention_share_keeps_one_token_set() -> None:
    generator = torch.Generator().manual_seed(3)
    layers, heads, t, d = 2, 2, 24, 8
    observations = [
        LayerObservation(
            keys=torch.randn(heads, t, d, generator=generator),
            values=torch.randn(heads, t, d, generator=generator),
            window_queries=torch.randn(2 * heads, 6, d, generator=generator),
        )
        for _ in range(layers)
    ]
    inputs = CompactionInputs(t, heads, observations, query_positions=torch.arange(t - 6, t))
    params = {"budget": 6, "n_sink": 1, "n_future_positions": 4}
    own = make_policy("expected_attention", **params).plan(inputs)
    rows = {tuple(r.tolist()) for layer in own.kept for r in layer}
    assert len(rows) > 1  # per head, the heads differ
    shared = make_policy("expected_attention", share=True, **params).plan(inputs)
    rows = {tuple(r.tolist()) for layer in shared.kept for r in layer}
    assert len(rows) == 1 and next(iter(rows))[0] == 0  # one set, with the sink
    pooled = make_policy("expected_attention", kernel_size=5, **params)
    plain = make_policy("expected_attention", **params)
    assert isinstance(pooled, ScorePolicy) and isinstance(plain, ScorePolicy)
    scores, before = pooled.score(inputs, 0), plain.score(inputs, 0)
    assert bool((scores[:, 1:] >= before[:, 1:]).all())  # a max-pool never lowers a score
    with pytest.raises(ValueError, match=r"kernel_size must be an odd integer >= 1, got 4"):
        make_policy("expected_attention", kernel_size=4)


def test_ragged_mask_is_the_global_top_k_with_a_cap_per_row() -> None:
    from lmcompact.policies.allocation import ragged_keep_mask

    scores = _two_busy_heads_and_an_idle_one()
    free = ragged_keep_mask(scores, 2, 12)  # kvpress's KVzipPress: no cap
    assert free.sum(dim=-1).tolist() == [[3, 3, 0]]  # the 6 best entries, wherever they are
    capped = ragged_keep_mask(scores, 2, 2)  # cap = keep: every head its own top-2
    assert capped.sum(dim=-1).tolist() == [[2, 2, 2]] and _kept(capped, 0, 2) == [9, 10]
    middle = ragged_keep_mask(scores, 2, 3)
    assert middle.sum() == 6 and int(middle.sum(dim=-1).max()) <= 3
    forced = scores.clone()
    forced[0, 2, 0] = float("inf")
    assert _kept(ragged_keep_mask(forced, 2, 12), 0, 2) == [0]
    valid = torch.ones(3, 12, dtype=torch.bool)
    valid[0, 4] = False
    assert 4 not in _kept(ragged_keep_mask(scores, 2, 12, valid), 0, 0)
    with pytest.raises(ValueError, match="keep <= cap"):
        ragged_keep_mask(scores, 3, 2)


def test_ragged_mask_with_a_layer_cap_is_the_greedy_global_order() -> None:
    from lmcompact.policies.allocation import ragged_keep_mask

    torch.manual_seed(3)
    scores = torch.rand(3, 4, 40)
    scores[0] += 1.0  # layer 0 outranks the others: uncapped, it takes most of the budget
    free = ragged_keep_mask(scores, 5, 20)
    assert int(free[0].sum()) > 4 * 5 * 1.25
    capped = ragged_keep_mask(scores, 5, 20, layer_cap=25)
    assert int(capped.sum()) == 3 * 4 * 5 and capped.sum(dim=(1, 2)).tolist()[0] == 25
    assert int(capped.sum(dim=-1).max()) <= 20
    # the same as walking the global order and skipping full rows and layers
    want = torch.zeros_like(capped)
    rows, layers = torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    for flat in torch.argsort(scores.flatten(), descending=True).tolist():
        layer, head, token = flat // 160, (flat // 40) % 4, flat % 40
        if rows[layer, head] < 20 and layers[layer] < 25 and int(want.sum()) < 60:
            want[layer, head, token] = True
            rows[layer, head] += 1
            layers[layer] += 1
    assert torch.equal(capped, want)
    with pytest.raises(ValueError, match="below one layer's share"):
        ragged_keep_mask(scores, 5, 20, layer_cap=19)


def test_kvzip_ragged_plan_reads_the_cap_from_the_inputs() -> None:
    scores = _two_busy_heads_and_an_idle_one()[0]
    policy = make_policy("kvzip", budget=2 / 12, n_sink=0, kernel_size=1, allocation="ragged")

    def inputs(cap: int | None) -> CompactionInputs:
        layer = LayerObservation(keys=torch.zeros(3, 12, 4), context_scores=scores)
        return CompactionInputs(12, 3, [layer], budget_tokens=2, max_tokens=cap)

    assert policy.plan(inputs(None)).kept_counts().tolist() == [[2, 2, 2]]
    assert policy.plan(inputs(3)).kept_counts().tolist() == [[3, 3, 0]]
    with pytest.raises(ValueError, match="choose one"):
        make_policy("kvzip", budget=0.5, share=True, allocation="ragged")
