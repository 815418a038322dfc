"""The one builder of policy inputs (:mod:`lmcompact.compaction.policy_inputs`) against a
hand computation: softmax rows written out query by query, in float64."""

from __future__ import annotations

import math

import torch

from lmcompact.compaction.policy_inputs import (
    Queries,
    compaction_inputs,
    layer_observation,
    prompt_observations,
    slice_candidates,
)
from lmcompact.policies import LayerObservation, Need

H, GROUP, T, D = 2, 2, 6, 4
START, SCALE = 10, 0.7
WINDOW = [4, 5]  # candidate indices of the window's queries (positions START + i)
SAMPLE = [1, 3]  # of the policy's context sample
EVERYTHING = (
    Need.KEYS
    | Need.WINDOW_SCORES
    | Need.WINDOW_ATTENTION
    | Need.CUMULATIVE_SCORES
    | Need.CONTEXT_SCORES
    | Need.WINDOW_QUERIES
)


def case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(H, T, D, generator=gen)
    values = torch.randn(H, T, D, generator=gen)
    queries = torch.randn(H * GROUP, T, D, generator=gen)  # the query at every position
    return keys, values, queries


def weights(keys: torch.Tensor, query: torch.Tensor, head: int, at: int) -> list[float]:
    """Softmax weights of one query (at candidate index ``at``) over the keys it sees."""
    logits = [SCALE * float(query.double() @ keys[head, j].double()) for j in range(at + 1)]
    top = max(logits)
    exp = [math.exp(x - top) for x in logits]
    return [e / sum(exp) for e in exp] + [0.0] * (T - at - 1)


def by_hand(keys: torch.Tensor, queries: torch.Tensor) -> dict[str, torch.Tensor]:
    rows = torch.zeros(H, len(WINDOW), T, dtype=torch.float64)
    cumulative = torch.zeros(H, T, dtype=torch.float64)
    context = torch.zeros(H, T, dtype=torch.float64)
    for h in range(H):
        for g in range(GROUP):
            q = queries[h * GROUP + g]
            for w, at in enumerate(WINDOW):
                rows[h, w] += torch.tensor(weights(keys, q[at], h, at)) / GROUP
            for at in range(T):
                cumulative[h] += torch.tensor(weights(keys, q[at], h, at)) / GROUP
            for at in SAMPLE:
                context[h] = torch.maximum(context[h], torch.tensor(weights(keys, q[at], h, at)))
    return {
        "window_attention": rows,
        "window_scores": rows.sum(dim=1),
        "cumulative_scores": cumulative,
        "context_scores": context,
    }


def queries_at(queries: torch.Tensor, indices: list[int]) -> Queries:
    return Queries(queries[:, indices], torch.tensor(indices) + START)


def test_layer_observation_equals_the_hand_computation() -> None:
    keys, values, queries = case()
    obs = layer_observation(
        EVERYTHING,
        keys,
        values,
        window=queries_at(queries, WINDOW),
        sample=queries_at(queries, SAMPLE),
        every_query=queries,
        scale=SCALE,
        start=START,
    )
    for name, want in by_hand(keys, queries).items():
        got = getattr(obs, name)
        assert got is not None, name
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6, msg=name)
    assert obs.keys is keys and obs.values is values
    # Expected Attention's statistics: the window's queries and the sample's, by position
    assert obs.window_queries is not None
    assert torch.equal(obs.window_queries, queries[:, sorted(SAMPLE + WINDOW)])


def test_only_the_needed_fields_are_set_and_observed_ones_win() -> None:
    keys, values, queries = case()
    window = queries_at(queries, WINDOW)
    obs = layer_observation(Need.WINDOW_SCORES, keys, values, window=window, scale=SCALE)
    assert obs.window_scores is not None
    assert all(
        getattr(obs, name) is None
        for name in ("keys", "values", "window_attention", "cumulative_scores", "context_scores")
    )
    given = torch.rand(H, T)
    again = layer_observation(
        Need.WINDOW_SCORES | Need.KEYS,
        keys,
        values,
        window=window,
        observed=LayerObservation(window_scores=given, cumulative_scores=torch.rand(H, T)),
        scale=SCALE,
    )
    assert again.window_scores is given and again.keys is keys
    assert again.cumulative_scores is None  # observed, but not needed
    # nothing to compute from: the policy's own input check names what is missing
    assert layer_observation(Need.CONTEXT_SCORES, keys).context_scores is None


def test_prompt_observations_are_the_builder_per_row() -> None:
    keys, _, queries = case()
    # a prompt of T tokens from position 0: the window is its last two, the sample SAMPLE
    batch_q = torch.stack([queries, queries.flip(1)])
    batch_k = torch.stack([keys, keys.flip(1)])
    rows = prompt_observations(
        EVERYTHING,
        batch_q,
        batch_k,
        window=len(WINDOW),
        scale=SCALE,
        context_positions=torch.tensor(SAMPLE),
    )
    assert len(rows) == 2
    for b, obs in enumerate(rows):
        assert obs.keys is None  # keys join when the policy plans
        want = by_hand(batch_k[b], batch_q[b])
        for name, tensor in want.items():
            got = getattr(obs, name)
            torch.testing.assert_close(got.double(), tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_inputs_and_slices() -> None:
    keys, values, queries = case()
    obs = layer_observation(
        EVERYTHING,
        keys,
        values,
        window=queries_at(queries, WINDOW),
        sample=queries_at(queries, SAMPLE),
        every_query=queries,
        scale=SCALE,
        start=START,
    )
    part = slice_candidates(obs, 2, 5)
    assert part.keys is not None and torch.equal(part.keys, keys[:, 2:5])
    assert part.window_attention is not None and part.window_attention.shape == (H, 2, 3)
    assert part.window_queries is obs.window_queries
    masks = (torch.zeros(T, dtype=torch.bool), torch.ones(T, dtype=torch.bool))
    positions = torch.tensor(sorted(SAMPLE + WINDOW)) + START
    inputs = compaction_inputs(
        Need.KEYS, [obs], T, H, token_masks=masks, query_positions=positions, budget_tokens=3
    )
    assert inputs.special_mask is None and inputs.query_positions is None  # not read
    assert inputs.budget_tokens == 3 and inputs.num_candidates == T
    inputs = compaction_inputs(
        Need.TOKEN_CLASSES | Need.WINDOW_QUERIES,
        [obs],
        T,
        H,
        token_masks=masks,
        query_positions=positions,
    )
    assert inputs.punctuation_mask is masks[1] and inputs.query_positions is positions
