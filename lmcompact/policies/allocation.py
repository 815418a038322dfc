"""Global top-k over every (layer, head, token), projected onto one count per (layer, head).

KVzip's own selection (and kvpress's ``KVzipPress`` with ``layerwise=False``) ranks the
scores of all layers and heads together and keeps the best ``L x H x K`` entries: a head
whose keys matter keeps many, a head that reads nothing keeps few. A layout with one
count per (layer, head) (the vLLM store: one block-aligned hole per request) cannot hold
those ragged counts, but it can keep what the global choice says matters::

    scores (L, H, T) --global top L*H*K--> chosen (L, H, T)    (ragged per head)
                                            votes (T,) = share of (layer, head) choosing t
    per (layer, head), K slots:
        head chose >= K tokens:  its own K best (the global threshold cut its list)
        head chose  < K tokens:  all it chose, then the tokens most heads chose (votes)
    share:  one token set for every (layer, head): the K tokens with the most votes

The total of kept entries is ``L x H x K`` as with per-head top-k, so the memory is the
same; what changes is which tokens the spare slots of an idle head hold (those other
heads need, rather than its own weak preferences).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcompact.plan import KeepPlan
from lmcompact.policies._select import descending_order, topk_mask

__all__ = ["global_keep_mask", "global_keep_plan", "ragged_keep_mask", "rank_fraction"]

_TIE = 1e-4
"""Weight of a head's own rank in the vote ranking (votes differ by >= 1 / (L x H))."""


def rank_fraction(scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``(R, T)`` float64 in ``(0, 1]``: 1 for each row's best score, falling by ``1 / T``
    per place (:func:`descending_order`'s order: ties to the later candidate)."""
    rows, length = scores.shape
    order = descending_order(scores.detach().double(), valid)
    places = torch.empty_like(order)
    places.scatter_(-1, order, torch.arange(length, device=order.device).expand(rows, -1))
    return 1.0 - places.double() / length


def global_keep_mask(
    scores: torch.Tensor, keep: int, valid: torch.Tensor | None = None, share: bool = False
) -> torch.Tensor:
    """``(L, H, T)`` bool: ``keep`` tokens per (layer, head), chosen by a global top-k.

    Args:
        scores: ``(L, H, T)`` float scores (+inf forces a keep; NaN is an error).
        keep: tokens every (layer, head) keeps (clipped to its valid candidates).
        valid: ``(H, T)`` bool, False for padding (never kept); None: all valid.
        share: every (layer, head) keeps the same tokens, ranked by votes.

    Returns:
        The CPU keep mask; row ``(l, h)`` holds ``min(keep, valid[h].sum())`` Trues.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be (layers, heads, T), got {tuple(scores.shape)}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    layers, heads, length = scores.shape
    # the whole choice on the CPU: a few (L*H, T) passes, and the mask goes there anyway
    flat_valid = None
    if valid is not None:
        flat_valid = valid.cpu().expand(layers, heads, length).reshape(layers * heads, length)
    rows = scores.detach().double().cpu().reshape(layers * heads, length)
    total = layers * heads * keep
    everything_valid = None if flat_valid is None else flat_valid.reshape(1, -1)
    chosen = topk_mask(rows.reshape(1, -1), total, everything_valid).view(layers * heads, length)
    votes = chosen.double().mean(dim=0)  # (T,) share of (layer, head) rows choosing t
    rank = rank_fraction(rows, flat_valid)
    if share:
        key = (votes + _TIE * rank.mean(dim=0)).expand(layers * heads, -1)
    else:
        # chosen entries first, by the row's own rank; then the rest by votes
        key = torch.where(chosen, 2.0 + rank, votes + _TIE * rank)
    return topk_mask(key, keep, flat_valid).view(layers, heads, length)


def global_keep_plan(
    scores: Sequence[torch.Tensor], keep: int, valid: torch.Tensor | None, share: bool
) -> KeepPlan:
    """The :class:`KeepPlan` of :func:`global_keep_mask` over per-layer ``(H, T)`` scores."""
    stacked = torch.stack([s.detach() for s in scores])
    return KeepPlan.from_masks(global_keep_mask(stacked, keep, valid, share=share))


def ragged_keep_mask(
    scores: torch.Tensor,
    keep: int,
    cap: int,
    valid: torch.Tensor | None = None,
    layer_cap: int | None = None,
) -> torch.Tensor:
    """``(L, H, T)`` bool: KVzip's own ragged choice, the global top ``L x H x keep``
    entries, each (layer, head) keeping at most ``cap`` (its best ``cap`` are eligible) and
    each layer at most ``layer_cap`` (its best ``layer_cap`` eligible entries are).

    kvpress's ``KVzipPress`` (``layerwise=False``) is this with no caps; a layout that holds
    every head's count (the vLLM store's ``store.per_head``: dense cells per layer) needs
    them. Taking the global order and skipping a full layer's entries is the same as ranking
    each layer's eligible entries first, as here.

    Args:
        scores: ``(L, H, T)`` float scores (+inf forces a keep; NaN is an error).
        keep: mean tokens per (layer, head); ``L x H x keep`` are kept in all.
        cap: most tokens one (layer, head) keeps (>= ``keep``).
        valid: ``(H, T)`` bool, False for padding (never kept); None: all valid.
        layer_cap: most tokens one layer keeps (>= ``H x keep``); None: no bound.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be (layers, heads, T), got {tuple(scores.shape)}")
    if not 1 <= keep <= cap:
        raise ValueError(f"need 1 <= keep <= cap, got keep {keep}, cap {cap}")
    layers, heads, length = scores.shape
    rows = scores.detach().double().cpu().reshape(layers * heads, length)
    flat_valid = None
    if valid is not None:
        flat_valid = valid.cpu().expand(layers, heads, length).reshape(layers * heads, length)
    if layer_cap is not None and layer_cap < heads * keep:
        raise ValueError(f"layer_cap {layer_cap} is below one layer's share {heads * keep}")
    eligible = topk_mask(rows, cap, flat_valid)  # each row's best ``cap`` (NaN raises)
    if layer_cap is not None:
        per_layer = rows.reshape(layers, heads * length)
        eligible = topk_mask(per_layer, layer_cap, eligible.reshape(layers, -1))
    chosen = topk_mask(rows.reshape(1, -1), layers * heads * keep, eligible.reshape(1, -1))
    return chosen.view(layers, heads, length)
