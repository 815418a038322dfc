"""Window-scored decode merges, engine-free, against a torch reference.

The reference reads the request's tokens as one dense sequence (kept region, merged block,
tail), computes each window query's softmax over the keys it saw with plain matmuls per
query head, scores the candidates with the policy as a whole sequence would be scored, and
keeps the ``K - s`` best of the kept region and the merged block: the paged merge must
write exactly those tokens into the kept region, in order, for both page layouts.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmcompact.compaction.heavy_hitters import MergeJob
from lmcompact.compaction.page_layout import make_layout
from lmcompact.compaction.window_merge import (
    WindowScores,
    decode_policy,
    decode_window,
    merge_by_window,
)
from lmcompact.policies import CompactionInputs, LayerObservation, make_policy

BS, H, G, D, L = 4, 2, 2, 8, 2
SCALE = 1 / math.sqrt(D)
KEPT, MERGED, TAIL = [5, 2, 9], [7], [11, 3]  # K = 12 (sinks 4), M = 4, tail 2 blocks
TAIL_TOKENS, W = 6, 3


def caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(16, H, BS, 2 * D, generator=gen) for _ in range(L)]


def reference_choice(
    policy_name: str, params: dict, dense_k: torch.Tensor, dense_v: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """``(H, K - s)`` kept candidate indices of one layer (dense ``(H, N, D)`` sequence)."""
    n = dense_k.shape[1]
    rows = torch.zeros(H, W, n)
    for h in range(H):
        for g in range(G):
            for i in range(W):
                pos = n - W + i
                logits = q[i, h * G + g] @ dense_k[h, : pos + 1].T * SCALE
                rows[h, i, : pos + 1] += torch.softmax(logits, dim=-1) / G
    pick = list(range(BS, 16)) + list(range(n - W, n))
    obs = LayerObservation(
        keys=dense_k[:, pick],
        values=dense_v[:, pick],
        window_scores=rows[:, :, pick].sum(dim=1),
        window_attention=rows[:, :, pick],
    )
    inputs = CompactionInputs(len(pick), H, [obs], budget_tokens=8 + W)
    policy = make_policy(policy_name, **params)
    scores = policy.score(inputs, 0)[:, :12].double()
    return scores.argsort(dim=-1, descending=True, stable=True)[:, :8].sort(dim=-1).values


@pytest.mark.parametrize("layout_name", ["head_major_kt", "token_major"])
@pytest.mark.parametrize(
    ("name", "params"),
    [("decoding_snapkv", {"window_size": W, "kernel_size": 3}), ("rkv", {"window_size": W})],
)
def test_merge_keeps_what_the_policy_ranks_best(layout_name: str, name: str, params: dict) -> None:
    layout = make_layout(layout_name, BS)
    kv = caches()
    gen = torch.Generator().manual_seed(5)
    queries = [torch.randn(W, H * G, D, generator=gen) for _ in range(L)]
    rows = KEPT + MERGED + TAIL
    dense = [layout.read(layer, rows, 0, 16 + TAIL_TOKENS) for layer in kv]
    job = MergeJob("r", tuple(KEPT), tuple(MERGED), BS, tuple(TAIL), TAIL_TOKENS)
    policy = decode_policy(name, params)

    chosen = merge_by_window(kv, layout, queries, [SCALE] * L, job, policy)

    for layer in range(L):
        keys, values = dense[layer]
        expected = reference_choice(name, params, keys, values, queries[layer])
        assert torch.equal(chosen[layer], expected)
        after_k, after_v = layout.read(kv[layer], KEPT, 0, 12)
        for h in range(H):
            assert torch.equal(after_k[h, :BS], keys[h, :BS])  # sinks stay
            assert torch.equal(after_k[h, BS:], keys[h, BS + expected[h]])
            assert torch.equal(after_v[h, BS:], values[h, BS + expected[h]])
    assert any(bool((c >= 8).any()) for c in chosen[0]), "some head took merged tokens"


def test_merge_without_recorded_queries_keeps_the_older_tokens_on_ties() -> None:
    layout = make_layout("token_major", BS)
    kv = caches()
    before = layout.read(kv[0], KEPT, 0, 12)[0]
    job = MergeJob("r", tuple(KEPT), tuple(MERGED), BS, tuple(TAIL), TAIL_TOKENS)
    empty = [torch.zeros(0, H * G, D) for _ in range(L)]
    policy = decode_policy("decoding_snapkv", {"window_size": W})
    chosen = merge_by_window(kv, layout, empty, [SCALE] * L, job, policy)
    assert all(torch.equal(c, torch.arange(8)) for c in chosen[0])
    assert torch.equal(layout.read(kv[0], KEPT, 0, 12)[0], before)


def test_only_window_score_policies_are_decode_policies() -> None:
    assert decode_window(decode_policy("rkv")) == 8
    assert decode_window(decode_policy("decoding_snapkv")) == 32
    with pytest.raises(ValueError, match="decode phase"):
        decode_policy("snapkv")  # prefill only
    with pytest.raises(ValueError, match="reads"):
        decode_policy("h2o")  # cumulative scores
    with pytest.raises(ValueError, match="unknown policy"):
        decode_policy("no_such_policy")


def test_observer_keeps_the_last_window_of_queries() -> None:
    from types import SimpleNamespace

    layout = make_layout("token_major", BS)
    kv = caches()
    names = [f"layer{i}" for i in range(L)]
    observer = WindowScores(
        layout=layout,
        kv_caches=dict(zip(names, kv, strict=True)),
        layer_index={n: i for i, n in enumerate(names)},
        scales=dict.fromkeys(names, SCALE),
        head_dim=D,
        policy=decode_policy("rkv", {"window_size": W}),
        window=W,
    )
    seen = []
    for step in range(5):
        observer.begin_step([], {5: "r"}, [])
        metadata = SimpleNamespace(
            query_start_loc=torch.tensor([0, 1, 2]), block_table=torch.tensor([[8, 1], [5, 2]])
        )
        query = torch.full((2, H * G * D), float(step))
        query[1] += 100.0  # request "r" is batch row 1
        for name in names:
            observer(name, query, metadata, torch.empty(0))
        seen.append(step + 100.0)
    kept = observer.queries["r"]
    assert [float(q[0, 0, 0]) for q in [kept[0][i : i + 1] for i in range(W)]] == seen[-W:]
    assert kept[1].shape == (W, H * G, D)
    observer.begin_step([], {}, ["r"])
    assert "r" not in observer.queries


def test_a_custom_score_policy_is_a_decode_policy() -> None:
    """A plain ScorePolicy subclass, registered, is accepted as ``release.decode_policy``."""
    from dataclasses import dataclass

    from connectors.vllm.config import ReleaseOptions
    from lmcompact.policies import Need, Phase, ScorePolicy, register_policy

    @register_policy
    @dataclass
    class NewestKeys(ScorePolicy):
        name = "test_newest_keys"
        needs = Need.KEYS
        phases = Phase.BOTH
        window_size: int = 4

        def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
            return inputs.positions_or_arange().double()

    options = ReleaseOptions(
        decode_budget_tokens=6 * 32, decode_policy="test_newest_keys", decode_policy_params={}
    )
    assert options.merges and options.needs_piecewise
    assert isinstance(options.decode_policy_object(), NewestKeys)
    assert options.decode_recent_blocks(32) == 3
    with pytest.raises(ValueError, match="decode score policy"):
        ReleaseOptions(decode_budget_tokens=64, decode_policy="snapkv")
    with pytest.raises(ValueError, match="needs a policy name"):
        ReleaseOptions(decode_budget_tokens=64, decode_policy_params={"window_size": 2})


@pytest.mark.parametrize("name", ["decoding_snapkv", "rkv"])
def test_sliding_layers_keep_the_newest_candidates_and_others_their_choice(name: str) -> None:
    """``recent_layers`` (sliding-window ones) keep the run that ends at the merged block,
    unscored; the other layers choose exactly as without them."""
    layout = make_layout("token_major", BS)
    gen = torch.Generator().manual_seed(5)
    queries = [torch.randn(W, H * G, D, generator=gen) for _ in range(L)]
    job = MergeJob("r", tuple(KEPT), tuple(MERGED), BS, tuple(TAIL), TAIL_TOKENS)
    policy = decode_policy(name, {"window_size": W})
    plain = merge_by_window(caches(), layout, queries, [SCALE] * L, job, policy)
    kv = caches()
    before = layout.read(kv[1], KEPT + MERGED, 0, 16)[0]
    no_queries = [queries[0], torch.zeros(0, H * G, D)]  # sliding layers record none
    chosen = merge_by_window(kv, layout, no_queries, [SCALE] * L, job, policy, frozenset({1}))
    assert torch.equal(chosen[0], plain[0])
    assert torch.equal(chosen[1], torch.arange(4, 12).expand(H, -1))
    assert not torch.equal(plain[1], chosen[1])
    after = layout.read(kv[1], KEPT, 0, 12)[0]
    assert torch.equal(after[:, :BS], before[:, :BS])  # sinks stay
    assert torch.equal(after[:, BS:], before[:, 2 * BS :])  # one run up to the merged block
