"""Selection shared by the policies: top-k per head, recency, sinks, pooling, budget splits.

:func:`topk_mask` is the one top-k of the project (policies, Ada-KV's safeguard,
FastGen's caps and the GPU pack all rank through :func:`descending_order`), and
:func:`pool_scores` is :mod:`lmcompact.attention.pooling`'s (re-exported here).

Every helper works on padded decode candidates: ``valid`` marks real entries and
``positions`` gives their original positions, so "most recent" means the highest
original position among valid candidates, not the last slot.
"""

from __future__ import annotations

import math

import torch

from lmcompact.attention.pooling import POOLINGS, pool_scores
from lmcompact.policies.inputs import CompactionInputs

__all__ = [
    "POOLINGS",
    "descending_order",
    "pool_scores",
    "recent_mask",
    "rows_of",
    "sink_mask",
    "split_evenly",
    "topk_keep",
    "topk_mask",
    "topk_mask_here",
]


def recent_mask(inputs: CompactionInputs, count: int | torch.Tensor) -> torch.Tensor:
    """``(H, T)`` bool: the ``count`` most recent valid candidates of each head.

    Args:
        inputs: Supplies ``positions`` and ``valid``.
        count: Candidates to mark, one int or an ``(H,)`` tensor; clipped to the
            number of valid candidates.
    """
    positions = inputs.positions_or_arange().to(torch.float64)
    valid = inputs.valid_or_all()
    return topk_mask(positions, count, valid)


def sink_mask(inputs: CompactionInputs, n_sink: int) -> torch.Tensor:
    """``(H, T)`` bool: valid candidates whose original position is below ``n_sink``."""
    return (inputs.positions_or_arange() < n_sink) & inputs.valid_or_all()


def topk_keep(
    scores: torch.Tensor, k: int | torch.Tensor, valid: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Per head, the sorted indices of the ``k`` highest scores among valid candidates.

    Ties go to the later (more recent) candidate, so results are deterministic.
    Invalid candidates are never kept, whatever their score (even ``-inf``
    valid candidates rank above them).

    Args:
        scores: ``(H, T)`` float scores (higher is kept first; NaN is an error).
        k: Tokens to keep, one int for all heads or an ``(H,)`` tensor.
        valid: ``(H, T)`` bool mask; invalid candidates are never kept.

    Returns:
        ``H`` sorted int64 CPU tensors of candidate indices; head ``h`` keeps
        ``min(k[h], valid[h].sum())`` of them.
    """
    return rows_of(topk_mask(scores, k, valid))


def topk_mask(
    scores: torch.Tensor, k: int | torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``(R, T)`` bool CPU mask of :func:`topk_keep`'s choice, for any number of rows.

    One sort over all rows (callers stack every layer's heads into ``R``), so
    the cost is a few tensor ops whatever the number of layers and heads.
    """
    return topk_mask_here(scores, k, valid).cpu()


def topk_mask_here(
    scores: torch.Tensor, k: int | torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`topk_mask` left on ``scores``' device (for callers that go on ranking there)."""
    # sort where the scores are: a copy to the host would sort every layer's heads there
    device = scores.device
    scores = scores.detach().double()
    num_rows, length = scores.shape
    valid_on = None if valid is None else valid.to(device)
    if valid_on is None:
        if bool(torch.isnan(scores).any()):
            raise ValueError(
                "scores contain NaN for valid candidates; a policy must score every one"
            )
        available = torch.full((num_rows,), length, dtype=torch.int64, device=device)
    else:
        if bool(torch.isnan(scores[valid_on]).any()):
            raise ValueError(
                "scores contain NaN for valid candidates; a policy must score every one"
            )
        available = valid_on.sum(dim=-1)
    wanted = torch.as_tensor(k, dtype=torch.int64).to(device).expand(num_rows)
    counts = torch.minimum(wanted, available)
    order = descending_order(scores, valid_on)
    rank_of_slot = torch.empty_like(order)
    ranks = torch.arange(length, device=device).expand(num_rows, -1).contiguous()
    rank_of_slot.scatter_(-1, order, ranks)
    return rank_of_slot < counts.clamp(min=0).unsqueeze(-1)


def rows_of(mask: torch.Tensor) -> list[torch.Tensor]:
    """Sorted int64 column indices of the True entries of each row of ``(R, T)`` ``mask``."""
    columns = torch.nonzero(mask, as_tuple=False)[:, 1]
    return list(torch.split(columns, mask.sum(dim=-1).tolist()))


def descending_order(scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``(H, T)`` candidate indices, best first: valid before invalid, then by score
    (descending), ties to the later candidate. ``valid=None`` means all valid."""
    flipped = torch.flip(scores, dims=[-1])
    order = torch.sort(flipped, dim=-1, descending=True, stable=True).indices
    order = scores.shape[-1] - 1 - order
    if valid is None or bool(valid.all()):
        return order
    rank_valid = torch.gather(valid, -1, order)
    regroup = torch.sort(rank_valid.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return torch.gather(order, -1, regroup)


def split_evenly(total: int, weights: list[float], caps: list[int]) -> list[int]:
    """Integers proportional to ``weights`` summing to ``min(total, sum(caps))``, each <= its cap.

    Largest-remainder rounding; what a capped entry cannot take is handed to the
    others in proportion to their weights (water filling).
    """
    total = min(total, sum(caps))
    out = [0] * len(weights)
    open_items = [i for i, c in enumerate(caps) if c > 0]
    remaining = total
    while remaining > 0 and open_items:
        weight_sum = sum(max(weights[i], 0.0) for i in open_items)
        if weight_sum <= 0:
            shares = {i: remaining / len(open_items) for i in open_items}
        else:
            shares = {i: remaining * max(weights[i], 0.0) / weight_sum for i in open_items}
        floors = {i: min(math.floor(shares[i]), caps[i] - out[i]) for i in open_items}
        given = sum(floors.values())
        for i, n in floors.items():
            out[i] += n
        left = remaining - given
        by_fraction = sorted(open_items, key=lambda i: (shares[i] - floors[i], -i), reverse=True)
        for i in by_fraction:
            if left == 0:
                break
            if out[i] < caps[i]:
                out[i] += 1
                left -= 1
        remaining = left
        open_items = [i for i in open_items if out[i] < caps[i]]
    return out
