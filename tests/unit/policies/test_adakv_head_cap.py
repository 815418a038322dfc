"""Ada-KV under a layout's per-head cap (``max_tokens``): one capped top-k per layer."""

from __future__ import annotations

import math

import torch

from lmcompact.compaction.pack import WindowQueries, pack_in_place
from lmcompact.compaction.page_layout import make_layout
from lmcompact.policies import CompactionInputs, LayerObservation, make_policy

H, T, KEEP, CAP = 4, 64, 16, 24


def skewed_scores() -> torch.Tensor:
    """Heads 0 and 1 spread their mass (every token a little), heads 2 and 3 put it on
    a few tokens: uncapped, Ada-KV hands the spread heads more than CAP tokens each."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(H, T, generator=gen, dtype=torch.float64)
    scores[:2] = 0.5 + 0.01 * scores[:2]
    scores[2:] *= 0.001
    scores[2, [5, 9, 40]] = 10.0
    scores[3, [1, 33]] = 10.0
    return scores


def inputs(max_tokens: int | None) -> CompactionInputs:
    return CompactionInputs(
        num_candidates=T,
        num_kv_heads=H,
        layers=[LayerObservation()],
        budget_tokens=KEEP,
        max_tokens=max_tokens,
        max_layer_tokens=None if max_tokens is None else KEEP * H,
    )


def capped_reference(scores: torch.Tensor) -> torch.Tensor:
    """Each head's own best CAP compete; its best ceil(0.2 KEEP) are kept first; then the
    best remaining pairs over the layer until KEEP x H."""
    allowed = torch.zeros_like(scores, dtype=torch.bool)
    guard = torch.zeros_like(allowed)
    for head in range(H):
        order = scores[head].argsort(descending=True)
        allowed[head, order[:CAP]] = True
        guard[head, order[: math.ceil(0.2 * KEEP)]] = True
    ranked = scores.masked_fill(guard, math.inf).masked_fill(~allowed, -math.inf).flatten()
    keep = torch.zeros(H * T, dtype=torch.bool)
    keep[ranked.argsort(descending=True)[: KEEP * H]] = True
    return keep.view(H, T)


def test_capped_layer_is_the_capped_top_k() -> None:
    policy = make_policy("adakv", budget=KEEP)
    scores = skewed_scores()
    free = policy.layer_mask(scores, inputs(None)).sum(dim=1)
    assert int(free.max()) > CAP  # the cap binds here
    mask = policy.layer_mask(scores, inputs(CAP))
    assert torch.equal(mask, capped_reference(scores))
    counts = mask.sum(dim=1)
    assert int(counts.max()) == CAP and int(counts.sum()) == KEEP * H


def test_per_head_pack_plans_once_and_fills_its_cells() -> None:
    """The in-place pack asks the policy once (no budget search) and every layer's cells
    are full: spread heads at the cap, the rest to the concentrated ones."""
    bs, d, hq = 8, 4, 4
    layout = make_layout("token_major", bs)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(T // bs + 1, H, bs, 2 * d, generator=gen)
    kv[:, 2:, :, :d] *= 6.0  # large keys: peaked attention for heads 2 and 3
    row = list(range(T // bs + 1))
    window = WindowQueries([torch.randn(8, hq, d, generator=gen)], torch.arange(T - 8, T), 1.0)
    policy = make_policy("adakv", budget=KEEP, scorer_params={"window_size": 8})
    timings: dict[str, float] = {}
    chosen = pack_in_place(
        [kv], layout, row, T, KEEP, policy, window, reserved=KEEP, head_cap=CAP, timings=timings
    )
    counts = [int(k.numel()) for k in chosen[0]]
    assert timings["plans"] == 1
    assert sum(counts) == KEEP * H and max(counts) <= CAP and len(set(counts)) > 1


def test_all_layers_ranked_at_once_equal_each_layer_ranked_alone() -> None:
    """``layer_masks`` sorts every layer in one call; each layer's mask is the capped
    reference of its own scores (three layers of different shapes of skew)."""
    policy = make_policy("adakv", budget=KEEP)
    gen = torch.Generator().manual_seed(5)
    stacked = torch.stack(
        [
            skewed_scores(),
            torch.rand(H, T, generator=gen, dtype=torch.float64),
            skewed_scores().flip(0),
        ]
    )
    masks = policy.layer_masks(stacked, inputs(CAP))
    assert masks.shape == (3, H, T)
    for layer in range(3):
        assert torch.equal(masks[layer], capped_reference(stacked[layer]))
        assert int(masks[layer].sum()) == KEEP * H
