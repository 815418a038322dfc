"""KVzip reconstruction scores (the repeat's queries against the first copy's keys) and the
request marker that asks the connector for them."""

from __future__ import annotations

import pytest
import torch

from connectors.vllm.reconstruct import (
    ReconstructRequest,
    ReconstructScores,
    reconstruct_params,
    reconstruct_request,
)
from lmcompact.attention.scores import reconstruction_scores
from lmcompact.policies.kvzip import reconstruction_ids


def _naive(
    queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, t: int
) -> torch.Tensor:
    """Full causal softmax rows, max over queries and the GQA group, first ``t`` keys."""
    b, hq, s, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    k = keys.repeat_interleave(hq // hkv, dim=1)
    logits = queries @ k.transpose(-1, -2) * d**-0.5
    hidden = torch.arange(n).view(1, -1) > positions.view(-1, 1)
    weights = logits.masked_fill(hidden, float("-inf")).softmax(-1)
    return weights.view(b, hkv, hq // hkv, s, n).amax(dim=(2, 3))[:, :, :t]


def test_uniform_keys_give_each_context_key_one_over_the_first_row() -> None:
    # zero keys: query at position p weighs each visible key 1 / (p + 1); the largest
    # weight a context key gets is from the earliest repeat query (position 5 -> 1/6)
    t, n = 4, 9
    queries = torch.randn(1, 2, 4, 8)
    keys = torch.zeros(1, 1, n, 8)
    got = reconstruction_scores(queries, keys, torch.arange(5, 9), t)
    assert got.shape == (1, 1, t)
    torch.testing.assert_close(got, torch.full((1, 1, t), 1 / 6))


def test_a_copied_key_scores_one_and_matches_the_full_softmax() -> None:
    generator = torch.Generator().manual_seed(0)
    t, n, d = 6, 15, 16
    keys = torch.randn(1, 2, n, d, generator=generator) * 0.1
    queries = torch.randn(1, 4, t, d, generator=generator) * 0.1
    keys[0, 1, 3] = 0.0
    keys[0, 1, 3, 0] = 40.0
    queries[0, 2, 1, 0] = 40.0  # head 2 (kv group 1) of the query at position 10 reads key 3
    positions = torch.arange(n - t, n)
    got = reconstruction_scores(queries, keys, positions, t, query_chunk=2)
    assert float(got[0, 1, 3]) > 0.999
    torch.testing.assert_close(got, _naive(queries, keys, positions, t))
    # chunked steps fold together with a maximum
    first = reconstruction_scores(queries[:, :, :2], keys, positions[:2], t)
    rest = reconstruction_scores(queries[:, :, 2:], keys, positions[2:], t)
    torch.testing.assert_close(torch.maximum(first, rest), got)


def test_bad_inputs_are_refused() -> None:
    keys = torch.zeros(1, 1, 9, 8)
    queries = torch.zeros(1, 1, 2, 8)
    with pytest.raises(ValueError, match="after the context"):
        reconstruction_scores(queries, keys, torch.tensor([3, 6]), 4)
    with pytest.raises(ValueError, match="context_len"):
        reconstruction_scores(queries, keys, torch.tensor([5, 6]), 0)
    with pytest.raises(ValueError, match="query_positions"):
        reconstruction_scores(queries, keys, torch.tensor([5, 6, 7]), 4)


def test_running_scores_fold_steps_per_layer() -> None:
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 12, 8, generator=generator)
    queries = torch.randn(5, 4, 8, generator=generator)
    positions = torch.arange(7, 12)
    running = ReconstructScores(context_len=5, num_layers=2)
    running.observe(0, queries[:3], positions[:3], keys, 8**-0.5)
    running.observe(0, queries[3:], positions[3:], keys, 8**-0.5)
    whole = reconstruction_scores(
        queries.permute(1, 0, 2)[None], keys[None], positions, 5, scale=8**-0.5
    )[0]
    layers = running.per_layer()
    assert layers[1] is None and layers[0] is not None
    torch.testing.assert_close(layers[0], whole)
    assert running.queries == 5


def test_request_marker() -> None:
    context = [5, 6, 7, 8]
    prompt = reconstruction_ids(context, [1, 2])
    assert prompt == [5, 6, 7, 8, 1, 2, 5, 6, 7, 8]
    assert reconstruct_request(reconstruct_params(4), prompt) == ReconstructRequest(4, 6)
    assert reconstruct_request(reconstruct_params(4, 6), prompt) == ReconstructRequest(4, 6)
    # a prompt cut to fit the model's positions repeats only the context's beginning
    assert reconstruct_request(reconstruct_params(4, 6), prompt[:8]) == ReconstructRequest(4, 6)
    assert reconstruct_request(None, prompt) is None
    assert reconstruct_request({"other": 1}, prompt) is None
    with pytest.raises(ValueError, match="copy of its context"):
        reconstruct_request(reconstruct_params(4), [5, 6, 7, 8, 1, 2, 5, 6, 7, 9])
    with pytest.raises(ValueError, match="do not fit"):
        reconstruct_request(reconstruct_params(5), prompt)
    with pytest.raises(ValueError, match="do not fit"):
        reconstruct_request(reconstruct_params(4, 4), prompt)
    with pytest.raises(ValueError, match="context_len"):
        reconstruct_request({"lmcompact": {"reconstruct": {"context_len": "4"}}}, prompt)
    with pytest.raises(ValueError, match="> 0"):
        reconstruct_params(0)
    with pytest.raises(ValueError, match="empty"):
        reconstruction_ids([], [1])


def test_kvzip_share_keeps_one_token_set_for_every_layer_and_head() -> None:
    from lmcompact.policies import CompactionInputs, LayerObservation, make_policy
    from lmcompact.policies.kvzip import shared_scores

    # token 10 scores 0.9 in one head of one layer only; token 20 scores 0.5 everywhere:
    # per head, head (0, 0) keeps 10; shared, every head keeps 20 and none keeps 10
    scores = [torch.full((2, 32), 0.01) for _ in range(3)]
    scores[0][0, 10] = 0.9
    for s in scores:
        s[:, 20] = 0.5
    obs = [LayerObservation(context_scores=s) for s in scores]
    inputs = CompactionInputs(32, 2, obs, positions=torch.arange(32, 64).expand(2, -1))
    per_head = make_policy("kvzip", budget=1 / 32, kernel_size=1).plan(inputs)
    assert per_head.kept[0][0].tolist() == [10]
    shared = make_policy("kvzip", budget=1 / 32, kernel_size=1, share=True).plan(inputs)
    assert {
        tuple(shared.kept[layer][head].tolist()) for layer in range(3) for head in range(2)
    } == {(20,)}
    with pytest.raises(ValueError, match="at least one layer"):
        shared_scores(CompactionInputs(32, 2, [LayerObservation()]))
