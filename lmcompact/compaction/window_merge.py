"""Window-scored decode merges inside vLLM: any score policy picks what the kept region keeps.

The H2O decode layout (:mod:`lmcompact.compaction.heavy_hitters`) with the choice made by a
:class:`~lmcompact.policies.base.ScorePolicy` (``decoding_snapkv``, ``rkv`` or a custom one)
from the attention of the request's last ``W`` decode queries instead of mass accumulated
since the start::

    logical slots  [ sinks | kept region (K) | hole ..... | merged (M) | tail ... window (W) ]
    candidates             [ K - s            ]            [ M          ]       [ W          ]

Whenever blocks join the hole (every ``block_size`` generated tokens once the budget binds),
the worker gives the policy, per layer, the keys of the kept region's non-sink tokens, of the
blocks leaving and of the window's own tokens, and each window query's softmax row over every
key it saw (kept region, merged blocks, the tail up to itself; GQA groups averaged), cut to
those candidates. Per (layer, kv head) the ``K - s`` best scored of the kept region and the
merged blocks stay, written into the kept region in candidate order (older first), so every
head keeps the same count and vLLM's own kernels read kept region + tail as before.

Queries are recorded per request by an after-attention observer on its decode rows, so the
window of a merge is the last ``W`` tokens computed; a query's row is recomputed at the merge
over the kept region as it is then (an earlier merge may have changed it since the query ran).
The window's own tokens are the last ``W`` of the tail, whatever number of queries is
recorded: a merge with fewer (none: the prompt alone exceeds the budget) scores with the
rows it has, or zero attention, where ties keep the older candidates (as H2O does for
unscored prompt tokens).

Sliding-window layers (``recent_layers``) are neither recorded nor scored: at each merge they
keep the most recent candidates, so their kept region and tail stay one run of consecutive
positions that vLLM's window mask reads at its logical distance (the hole skips their sinks).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcompact.compaction.heavy_hitters import MergeJob, newest_candidates
from lmcompact.compaction.page_layout import PageLayout
from lmcompact.compaction.page_observer import PageObserver
from lmcompact.policies import (
    CompactionInputs,
    LayerObservation,
    Need,
    Phase,
    ScorePolicy,
    make_policy,
)
from lmcompact.policies.base import need_names

logger = logging.getLogger(__name__)

__all__ = ["WindowScores", "decode_policy", "decode_window", "merge_by_window", "window_rows"]


def window_rows(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax rows of the last ``W`` tokens' queries over the keys they saw.

    Args:
        queries: ``(W, Hq, D)``; query ``i`` is the token of key ``N - W + i`` (causal).
        keys: ``(H, N, D)`` in virtual slot order.
        scale: softmax scale.

    Returns:
        ``(H, W, N)`` float32, averaged over the query heads of each kv group.
    """
    w, hq, d = queries.shape
    h, n, _ = keys.shape
    q = queries.float().view(w, h, hq // h, d)
    logits = torch.einsum("whgd,hnd->hgwn", q, keys.float()) * scale
    future = torch.arange(n)[None, :] > torch.arange(n - w, n)[:, None]  # (W, N)
    logits = logits.masked_fill(future.to(logits.device)[None, None], float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=1)


def merge_by_window(
    kv_layers: Sequence[torch.Tensor],
    layout: PageLayout,
    queries: Sequence[torch.Tensor],
    scales: Sequence[float],
    job: MergeJob,
    policy: ScorePolicy,
    recent_layers: Collection[int] = (),
) -> list[torch.Tensor]:
    """Keep each (layer, head)'s ``K - s`` best scored of kept region + merged blocks.

    Args:
        kv_layers: per layer paged cache ``(num_blocks, Hkv, block_size, 2 * D)``.
        layout: their page layout.
        queries: per layer ``(W, Hq, D)`` queries of the request's last ``W`` computed
            tokens (``W`` may be 0), the newest last.
        scales: per layer softmax scale.
        job: the merge (its ``tail_blocks`` / ``tail_tokens`` hold the window's keys).
        policy: scores the candidates (see the module doc).
        recent_layers: layers (sliding-window ones) that keep the ``K - s`` most recent
            candidates, unscored (:func:`~lmcompact.compaction.heavy_hitters.newest_candidates`).

    Returns:
        Per layer, the ``(Hkv, K - s)`` chosen candidate indices (``< K - s``: a kept-region
        token, else ``K - s + i``: token ``i`` of the merged blocks).
    """
    bs = layout.block_size
    k, m, s = len(job.kept_blocks) * bs, len(job.merged_blocks) * bs, job.sink_tokens
    if s % bs or not 0 <= s < k or m == 0:
        raise ValueError(
            f"merge needs block-aligned sinks below the kept region and a block to merge, got "
            f"sinks={s}, kept={k}, merged={m} tokens"
        )
    t = job.tail_tokens
    window = min(decode_window(policy), t)  # the window's own tokens: the newest candidates
    scored = [layer for layer in range(len(kv_layers)) if layer not in recent_layers]
    w = min(window, *(int(queries[layer].shape[0]) for layer in scored)) if scored else 0
    observed: list[LayerObservation] = []
    candidates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in scored:
        kv = kv_layers[layer]
        kept_k, kept_v = layout.read(kv, job.kept_blocks, 0, k)  # (H, K, D)
        new_k, new_v = layout.read(kv, job.merged_blocks, 0, m)
        tail_k, tail_v = new_k[:, :0], new_v[:, :0]
        if t:
            tail_k, tail_v = layout.read(kv, job.tail_blocks, 0, t)
        keys = torch.cat([kept_k, new_k, tail_k], dim=1)  # what the window saw, in order
        heads = keys.shape[0]
        newest = torch.arange(k + m + t - window, k + m + t)
        pick = torch.cat([torch.arange(s, k + m), newest]).to(keys.device)
        if w:
            rows = window_rows(queries[layer][-w:].to(keys.device), keys, scales[layer])
            rows = rows[:, :, pick]
        else:
            rows = torch.zeros(heads, 1, len(pick), device=keys.device)
        values = torch.cat([kept_v, new_v, tail_v], dim=1)
        observed.append(
            LayerObservation(
                keys=keys[:, pick],
                values=values[:, pick],
                window_scores=rows.sum(dim=1),
                window_attention=rows,
            )
        )
        candidates[layer] = (keys[:, s : k + m], values[:, s : k + m])
    heads = int(kv_layers[0].shape[1])
    ranked_by_layer: dict[int, torch.Tensor] = {}
    if scored:
        inputs = CompactionInputs(
            num_candidates=k - s + m + window,
            num_kv_heads=heads,
            layers=observed,
            budget_tokens=k - s + window,
        )
        policy.check_inputs(inputs)
        ranked_by_layer = dict(zip(scored, policy.score_all(inputs), strict=True))
    chosen: list[torch.Tensor] = []
    for layer, kv in enumerate(kv_layers):
        if layer in ranked_by_layer:
            ranked = ranked_by_layer[layer][:, : k - s + m].double().cpu()
            order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
            index = order[:, : k - s].sort(dim=-1).values  # candidate order: older first
        else:
            index = newest_candidates(heads, k - s, m, torch.device("cpu"))
        chosen.append(index)
        if layer in candidates:
            keys, values = candidates[layer]
        else:
            kept_k, kept_v = layout.read(kv, job.kept_blocks, s, k - s)
            new_k, new_v = layout.read(kv, job.merged_blocks, 0, m)
            keys, values = torch.cat([kept_k, new_k], dim=1), torch.cat([kept_v, new_v], dim=1)
        gather = index.to(keys.device).unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        layout.write(
            kv, job.kept_blocks, s, torch.gather(keys, 1, gather), torch.gather(values, 1, gather)
        )
    return chosen


@dataclass
class _QueryRows:
    """The decode rows of one attention metadata object (built at its first layer)."""

    req_ids: list[str]
    spans: list[tuple[int, int]]  # each request's query tokens in the batch


class WindowScores(PageObserver[_QueryRows]):
    """Worker-side window merges: each scored request's last queries, and its merges.

    Args: those of :class:`lmcompact.compaction.page_observer.PageObserver`, ``policy`` (a
    :class:`~lmcompact.policies.base.ScorePolicy`) and ``window`` (W, queries kept).
    """

    def __init__(
        self,
        *pages: Any,
        policy: ScorePolicy,
        window: int,
        recent_layers: Collection[int] = (),
        **named: Any,
    ) -> None:
        if window < 1:
            raise ValueError(f"the decode window must be >= 1 query, got {window}")
        self.policy = policy
        self.window = window
        self.recent_layers = frozenset(recent_layers)
        super().__init__(*pages, **named)

    def _setup(self) -> None:
        self.names = sorted(self.layer_index, key=self.layer_index.__getitem__)
        self.queries: dict[str, list[torch.Tensor]] = {}  # req -> per layer (<= W, Hq, D)
        self.scored: dict[int, str] = {}  # this step: first physical block -> req
        self.stats: dict[str, int] = {"merges": 0, "merged_tokens": 0, "recorded": 0}
        scored = [i for i in self.layer_index.values() if i not in self.recent_layers]
        self.counted_layer = min(scored, default=-1)  # recorded queries counted once a step

    def begin_step(
        self, merges: Iterable[MergeJob], scored: Mapping[int, str], forgotten: Iterable[str]
    ) -> None:
        """A step's metadata was bound: drop requests vLLM took back, run the step's merges
        (before its loads and forward pass), note the rows whose queries to record."""
        for req_id in forgotten:
            self.queries.pop(req_id, None)
        layers = [self.kv_caches[name] for name in self.names]
        scales = [self.scales[name] for name in self.names]
        bs = self.layout.block_size
        for job in merges:
            recorded = self.queries.get(job.req_id)
            if recorded is None:
                recorded = [torch.zeros(0, 1, self.head_dim) for _ in self.names]
            merge_by_window(
                layers, self.layout, recorded, scales, job, self.policy, self.recent_layers
            )
            self.stats["merges"] += 1
            self.stats["merged_tokens"] += len(job.merged_blocks) * bs
        self.scored = dict(scored)
        self._new_step()

    def __call__(self, name: str, query: torch.Tensor, metadata: Any, output: torch.Tensor) -> None:
        """After-attention observer: keep this layer's queries of the scored rows."""
        layer = self.layer_index[name]
        if not self.scored or layer in self.recent_layers:
            return
        rows = self._batch_rows(metadata, query.device)
        if rows is None:
            return
        queries = query.view(query.shape[0], -1, self.head_dim)
        for req_id, (lo, hi) in zip(rows.req_ids, rows.spans, strict=True):
            kept = self.queries.setdefault(
                req_id, [queries[:0].detach().clone() for _ in self.names]
            )
            kept[layer] = torch.cat([kept[layer], queries[lo:hi].detach()])[-self.window :]
            if layer == self.counted_layer:
                self.stats["recorded"] += hi - lo

    def _build_rows(self, metadata: Any, device: torch.device) -> _QueryRows | None:
        num_reqs = int(metadata.query_start_loc.numel()) - 1
        firsts = metadata.block_table[:num_reqs, 0].tolist()
        starts = metadata.query_start_loc.tolist()
        req_ids, spans = [], []
        for r, first in enumerate(firsts):
            req_id = self.scored.get(first)
            if req_id is not None and starts[r + 1] > starts[r]:
                req_ids.append(req_id)
                spans.append((starts[r], starts[r + 1]))
        return _QueryRows(req_ids, spans) if req_ids else None


WINDOW_NEEDS = Need.KEYS | Need.WINDOW_SCORES | Need.WINDOW_ATTENTION
"""What a window merge gives a decode policy."""


def decode_policy(name: str, params: Mapping[str, Any] | None = None) -> ScorePolicy:
    """The score policy ``name`` as a window-merge decode policy; ValueError saying why not.

    It must be a :class:`~lmcompact.policies.base.ScorePolicy` with a decode phase that
    reads at most keys, window scores and window attention; its ``window_size`` (default 32)
    is the number of decode queries kept per request.
    """
    policy = make_policy(name, **dict(params or {}))
    if not isinstance(policy, ScorePolicy) or Phase.DECODE not in policy.phases:
        raise ValueError(
            f"decode policy {name!r} must be a ScorePolicy with a decode phase "
            "(Phase.DECODE or Phase.BOTH)"
        )
    if policy.needs & ~WINDOW_NEEDS:
        raise ValueError(
            f"decode policy {name!r} reads {need_names(policy.needs & ~WINDOW_NEEDS)}; a "
            "decode merge gives keys, window_scores and window_attention only"
        )
    return policy


def decode_window(policy: ScorePolicy) -> int:
    """Decode queries a window merge keeps for ``policy`` (its ``window_size``, else 32)."""
    return max(1, int(getattr(policy, "window_size", 32)))
