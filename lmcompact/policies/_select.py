"""Selection helpers shared by several policies: recency, sinks, pooling, budget splits.

Every helper works on padded decode candidates: ``valid`` marks real entries and
``positions`` gives their original positions, so "most recent" means the highest
original position among valid candidates, not the last slot.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lmcompact.policies.base import CompactionInputs, descending_order


def recent_mask(inputs: CompactionInputs, count: int | torch.Tensor) -> torch.Tensor:
    """``(H, T)`` bool: the ``count`` most recent valid candidates of each head.

    Args:
        inputs: Supplies ``positions`` and ``valid``.
        count: Candidates to mark, one int or an ``(H,)`` tensor; clipped to the
            number of valid candidates.
    """
    positions = inputs.positions_or_arange().to(torch.float64)
    valid = inputs.valid_or_all()
    return top_mask(positions, valid, count)


def sink_mask(inputs: CompactionInputs, n_sink: int) -> torch.Tensor:
    """``(H, T)`` bool: valid candidates whose original position is below ``n_sink``."""
    return (inputs.positions_or_arange() < n_sink) & inputs.valid_or_all()


def top_mask(scores: torch.Tensor, valid: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """``(H, T)`` bool: per head, the ``count`` best valid candidates by ``scores``."""
    num_heads, length = scores.shape
    device = scores.device  # sorted where the scores are; the mask comes back on the host
    valid = valid.to(device)
    counts = torch.as_tensor(count, dtype=torch.int64).to(device).expand(num_heads)
    counts = torch.minimum(counts.clamp(min=0), valid.sum(dim=-1))
    order = descending_order(scores.detach().double(), valid)
    rank_of_slot = torch.empty_like(order)
    ranks = torch.arange(length, device=device).expand(num_heads, -1).contiguous()
    rank_of_slot.scatter_(-1, order, ranks)
    return (rank_of_slot < counts.unsqueeze(-1)).cpu()


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Smooth ``(H, T)`` scores along T with a same-length 1-D max or average pool.

    Args:
        scores: ``(H, T)`` non-negative scores.
        kernel_size: Odd window width (1 disables pooling).
        pooling: ``"maxpool"`` or ``"avgpool"`` (zero padding counts in the average).
    """
    if kernel_size == 1:
        return scores
    x = scores.unsqueeze(1)
    pad = kernel_size // 2
    if pooling == "maxpool":
        out = F.max_pool1d(x, kernel_size, stride=1, padding=pad)
    else:
        out = F.avg_pool1d(x, kernel_size, stride=1, padding=pad, count_include_pad=True)
    return out.squeeze(1)


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
