"""H2O decode inside vLLM: accumulated attention per kept slot, merges into a kept region.

Heavy-Hitter Oracle (Zhang et al. 2023, https://arxiv.org/abs/2306.14048) keeps, per
(layer, head), the tokens with the largest attention mass accumulated over the queries so
far plus a recent window. With ``"release": {"decode_policy": "h2o"}`` a request's blocks
are laid out as::

    logical slots  [ sinks | kept region (heavy hitters) | hole ..... | tail: recent + partial ]
                   0       s                            K            (freed)
    virtual slots  [ 0 ............................... K | K ...... seq_len ]  (hole cut out)

Each (layer, kv head) fills the kept region with its own heavy hitters: slot ``i`` of head 0
may hold another token than slot ``i`` of head 1. Keys are stored post-RoPE, so a token's
slot does not matter to attention, and every head keeps the same count, so vLLM's own kernel
reads kept region + tail exactly (no recomputed attention, unlike per-head counts).

Scores (worker side, on the cache device): ``(L, Hkv, slots)`` float32 per request, in
virtual slots. Every decode step, after each layer's attention, the request's queries are
run once more through :func:`lmcompact.kernels.dispatch.paged_attention` with
``return_key_mass=True`` over the same hole-skipped block row vLLM used, and the per-key
mass (averaged over the GQA group) is added. That second pass over the request's visible
keys is this mode's cost: about one extra attention per layer for its decode rows (the
Triton kernel reading vLLM 0.26's pages in place on CUDA; on the CPU :func:`key_mass` over
each row's keys read through the page layout, all heads in one product).

Merges (scheduler -> worker): when the decode budget pushes the first tail block(s) into the
hole, the scheduler sends a :class:`MergeJob` in that step's metadata; the worker runs it
when the metadata is bound, before that step's loads and forward pass. Per (layer, head),
among the kept region's non-sink tokens and the blocks' tokens it keeps the top
``K - s`` by score (stable: on ties the older candidate stays), writes them into the kept
region in candidate order and moves their scores with them; the blocks' scores leave the
virtual slots. Those blocks were returned to vLLM's pool in the same ``schedule()``; the
earliest anyone writes them is that step's loads or forward pass, which run after the merge
(same stream on CUDA), and the merge never touches them again.

Where the kept region comes from: a prefill pack's kept blocks; otherwise the hole opens, once
the budget is first exceeded, after ``budget - decode_recent_tokens`` blocks, so the first
blocks of the sequence seed the kept region (a hole's start never moves: a kept region cannot
grow behind it without copying, so starting from the sinks alone would leave no room).

Limits: prompt tokens evicted before any decode query has scored them compete with score 0
(the prompt's own attention is not accumulated); a prefill pack's kept tokens also start at
0. Preemption drops the scores with the blocks. Per-head counts and StreamingLLM's
``blocks`` prefill are refused with this mode.

Sliding-window layers (Gemma-3's local layers) are not scored: a merge keeps their most
recent candidates (:func:`newest_candidates`), and the hole makes them skip the sinks
(``window_lead``), so what they read is one run of consecutive positions ending at the query,
at its logical distance, as vLLM's window mask by key index needs.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcompact.compaction.page_layout import PageLayout
from lmcompact.compaction.page_observer import PageObserver
from lmcompact.kernels import dispatch as kernels
from lmcompact.layout.paged import PagedLengths

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeJob:
    """Worker job: merge blocks that are joining the hole into the kept region.

    Attributes:
        req_id: request id.
        kept_blocks: physical ids of logical blocks ``[0, hole start)``: the kept region,
            sinks first.
        merged_blocks: physical ids of the blocks joining the hole, in logical order (read
            before vLLM reuses them).
        sink_tokens: leading slots never replaced (whole sink blocks).
        tail_blocks: physical ids of the blocks after the hole (the request's recent
            tokens), read by window-scored merges (:mod:`lmcompact.compaction.window_merge`).
        tail_tokens: tokens computed in ``tail_blocks``.
    """

    req_id: str
    kept_blocks: tuple[int, ...]
    merged_blocks: tuple[int, ...]
    sink_tokens: int
    tail_blocks: tuple[int, ...] = ()
    tail_tokens: int = 0


def merge_heavy_hitters(
    kv_layers: Sequence[torch.Tensor],
    layout: PageLayout,
    scores: torch.Tensor,
    kept_blocks: Sequence[int],
    merged_blocks: Sequence[int],
    sink_tokens: int,
    recent_layers: Collection[int] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Keep each (layer, head)'s top-scored tokens of kept region + merged blocks.

    Args:
        kv_layers: per layer paged cache ``(num_blocks, Hkv, block_size, 2 * D)``.
        layout: their page layout.
        scores: ``(L, Hkv, V)`` accumulated mass in virtual slots (kept region ``[0, K)``,
            the merged blocks ``[K, K + M)``), ``V >= K + M``.
        kept_blocks: physical ids of the kept region's blocks (``K = len * block_size``).
        merged_blocks: physical ids of the blocks leaving (``M = len * block_size``).
        sink_tokens: slots ``[0, sink_tokens)`` stay as they are (block aligned, < K).
        recent_layers: layers (sliding-window ones) that keep the ``K - s`` most recent
            candidates whatever their scores: :func:`newest_candidates`.

    Returns:
        The new scores ``(L, Hkv, V)`` (kept region rescored, the merged blocks' slots cut
        out, zeros appended) and, per layer, the ``(Hkv, K - s)`` chosen candidate indices
        (``< K - s``: a kept-region token, else ``K - s + i``: token ``i`` of the blocks).
    """
    bs = layout.block_size
    k, m, s = len(kept_blocks) * bs, len(merged_blocks) * bs, sink_tokens
    if s % bs or not 0 <= s < k or m == 0:
        raise ValueError(
            f"merge needs block-aligned sinks below the kept region and a block to merge, got "
            f"sinks={s}, kept={k}, merged={m} tokens"
        )
    if scores.dim() != 3 or scores.shape[0] != len(kv_layers) or scores.shape[2] < k + m:
        raise ValueError(
            f"scores must be (layers={len(kv_layers)}, heads, >= {k + m}), "
            f"got {tuple(scores.shape)}"
        )
    new_kept = torch.empty_like(scores[:, :, s:k])
    chosen: list[torch.Tensor] = []
    for layer, kv in enumerate(kv_layers):
        kept_k, kept_v = layout.read(kv, kept_blocks, s, k - s)  # (H, K - s, D)
        new_k, new_v = layout.read(kv, merged_blocks, 0, m)  # (H, M, D)
        candidates = torch.cat([scores[layer, :, s:k], scores[layer, :, k : k + m]], dim=-1)
        if layer in recent_layers:
            index = newest_candidates(candidates.shape[0], k - s, m, candidates.device)
        else:
            order = torch.sort(candidates, dim=-1, descending=True, stable=True).indices
            index = order[:, : k - s].sort(dim=-1).values  # candidate order: kept region first
        chosen.append(index)
        new_kept[layer] = torch.gather(candidates, 1, index)
        keys = torch.cat([kept_k, new_k], dim=1)
        values = torch.cat([kept_v, new_v], dim=1)
        gather = index.to(keys.device).unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        layout.write(
            kv, kept_blocks, s, torch.gather(keys, 1, gather), torch.gather(values, 1, gather)
        )
    merged = torch.cat(
        [
            scores[:, :, :s],
            new_kept,
            scores[:, :, k + m :],
            torch.zeros_like(scores[:, :, :m]),
        ],
        dim=-1,
    )
    return merged, chosen


def newest_candidates(heads: int, kept: int, merged: int, device: torch.device) -> torch.Tensor:
    """``(heads, kept)`` indices of the ``kept`` most recent of ``kept + merged`` candidates.

    What a sliding-window layer keeps at a merge: the merged blocks are the tokens right
    before the tail, so its kept region then holds one run of consecutive positions that
    ends where the tail starts, and with the sinks skipped (the hole's ``window_lead``)
    every key it reads sits at its logical distance from every query, as vLLM's window mask
    by key index needs (:mod:`lmcompact.compaction.holes`).
    """
    return torch.arange(merged, kept + merged, device=device).expand(heads, -1)


@dataclass
class _ScoredRows:
    """The H2O rows of one attention metadata object (built at its first layer)."""

    req_ids: list[str]
    query_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_table: torch.Tensor
    lengths: PagedLengths
    seq_lens: list[int]
    max_blocks: list[int]
    max_q_len: int
    validated: bool = False


class HeavyHitterScores(PageObserver[_ScoredRows]):
    """Worker-side H2O state: accumulated mass per request, merges (an attention observer).

    Args: those of :class:`lmcompact.compaction.page_observer.PageObserver` (``layer_index`` indexes
    the scores), ``num_kv_heads`` (Hkv) and ``recent_layers`` (sliding-window layers: their
    merges keep the most recent candidates, so they are not scored).
    """

    def __init__(
        self,
        *pages: Any,
        num_kv_heads: int,
        recent_layers: Collection[int] = (),
        **named_pages: Any,
    ) -> None:
        self.num_kv_heads = num_kv_heads
        self.recent_layers = frozenset(recent_layers)
        super().__init__(*pages, **named_pages)

    def _setup(self) -> None:
        self.device = next(iter(self.kv_caches.values())).device
        self.scores: dict[str, torch.Tensor] = {}  # req -> (L, Hkv, capacity) float32
        self.scored: dict[int, str] = {}  # this step: first physical block -> req
        self.stats: dict[str, int] = {"merges": 0, "merged_tokens": 0, "mass_calls": 0}

    # ------------------------------------------------------------------ state
    def scores_of(self, req_id: str, slots: int) -> torch.Tensor:
        """The request's scores, grown with zeros to at least ``slots`` virtual slots."""
        current = self.scores.get(req_id)
        have = 0 if current is None else current.shape[2]
        if have >= slots:
            assert current is not None
            return current
        grown = torch.zeros(
            len(self.layer_index),
            self.num_kv_heads,
            max(slots, 2 * have),
            dtype=torch.float32,
            device=self.device,
        )
        if current is not None:
            grown[:, :, :have] = current
        self.scores[req_id] = grown
        return grown

    def begin_step(
        self, merges: Iterable[MergeJob], scored: Mapping[int, str], forgotten: Iterable[str]
    ) -> None:
        """A step's metadata was bound: drop requests vLLM took back, run the step's merges
        (before its loads and forward pass), note the rows to score."""
        for req_id in forgotten:
            self.scores.pop(req_id, None)
        layers = list(self.kv_caches.values())
        bs = self.layout.block_size
        for job in merges:
            need = (len(job.kept_blocks) + len(job.merged_blocks)) * bs
            merged, _ = merge_heavy_hitters(
                layers,
                self.layout,
                self.scores_of(job.req_id, need),
                job.kept_blocks,
                job.merged_blocks,
                job.sink_tokens,
                self.recent_layers,
            )
            self.scores[job.req_id] = merged
            self.stats["merges"] += 1
            self.stats["merged_tokens"] += len(job.merged_blocks) * bs
        self.scored = dict(scored)
        self._new_step()

    # ------------------------------------------------------------------ attention
    def __call__(self, name: str, query: torch.Tensor, metadata: Any, output: torch.Tensor) -> None:
        """After-attention observer: add this layer's key mass of the scored rows."""
        layer = self.layer_index[name]
        if not self.scored or layer in self.recent_layers:
            return
        rows = self._batch_rows(metadata, query.device)
        if rows is None:
            return
        kv = self.kv_caches[name]
        queries = query.view(query.shape[0], -1, self.head_dim)[rows.query_index]
        if kernels.use_kernels(queries.device):
            mass = self._kernel_mass(kv, queries, rows, self.scales[name])
            for b, (req_id, n) in enumerate(zip(rows.req_ids, rows.seq_lens, strict=True)):
                self.scores[req_id][layer, :, :n] += mass[b, :, :n]
        else:
            cu = rows.cu_seqlens_q.tolist()
            table = rows.block_table.tolist()
            for b, (req_id, n) in enumerate(zip(rows.req_ids, rows.seq_lens, strict=True)):
                keys, _ = self.layout.read(kv, table[b][: rows.max_blocks[b]], 0, n)
                self.scores[req_id][layer, :, :n] += key_mass(
                    queries[cu[b] : cu[b + 1]], keys, self.scales[name]
                ).to(self.device)
        rows.validated = True
        self.stats["mass_calls"] += 1

    def _kernel_mass(
        self, kv: torch.Tensor, queries: torch.Tensor, rows: _ScoredRows, scale: float
    ) -> torch.Tensor:
        """``(B, Hkv, slots)`` mass from the paged kernel reading vLLM's pages in place."""
        key_pool, value_pool, table = self._pools(kv, rows.block_table, rows.max_blocks)
        _, mass = kernels.paged_attention(
            queries,
            key_pool,
            value_pool,
            table,
            rows.cu_seqlens_q,
            rows.lengths,
            scale=scale,
            return_key_mass=True,
            validate=not rows.validated,
            max_q_len=rows.max_q_len,
            max_visible=max(rows.seq_lens),
        )
        assert mass is not None
        return mass

    def _build_rows(self, metadata: Any, device: torch.device) -> _ScoredRows | None:
        num_reqs = int(metadata.query_start_loc.numel()) - 1
        firsts = metadata.block_table[:num_reqs, 0].tolist()
        picked = [(r, self.scored[f]) for r, f in enumerate(firsts) if f in self.scored]
        if not picked:
            return None
        bs = self.layout.block_size
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens[:num_reqs].tolist()
        rows, req_ids, index, cu, lens = [], [], [], [0], []
        for r, req_id in picked:
            q_len = starts[r + 1] - starts[r]
            if q_len == 0:
                continue
            rows.append(r)
            req_ids.append(req_id)
            index.append(torch.arange(starts[r], starts[r + 1]))
            cu.append(cu[-1] + q_len)
            lens.append(int(seq_lens[r]))
            self.scores_of(req_id, int(seq_lens[r]))  # grown once per step, not per layer
        if not rows:
            return None
        table = metadata.block_table[torch.tensor(rows, device=metadata.block_table.device)]
        seq_len = torch.tensor(lens, dtype=torch.int64, device=device)
        return _ScoredRows(
            req_ids=req_ids,
            query_index=torch.cat(index).to(device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            block_table=table.to(device).contiguous(),
            lengths=PagedLengths.uncompacted(seq_len, self.num_kv_heads),
            seq_lens=lens,
            max_blocks=[-(-n // bs) for n in lens],
            max_q_len=max(cu[i + 1] - cu[i] for i in range(len(rows))),
        )


def key_mass(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention mass per key of one request's last queries (the CPU path, all heads at once).

    Args:
        queries: ``(S, Hq, D)`` post-RoPE queries of the request's last ``S`` tokens.
        keys: ``(Hkv, N, D)`` the keys it sees, in virtual slot order (query ``i`` is token
            ``N - S + i``: causal).
        scale: softmax scale.

    Returns:
        ``(Hkv, N)`` float32: probabilities summed over the queries, averaged over the
        query heads of each kv group (as :func:`lmcompact.kernels.dispatch.paged_attention`
        with ``return_key_mass=True``).
    """
    s, hq, d = queries.shape
    hkv, n, _ = keys.shape
    q = queries.float().view(s, hkv, hq // hkv, d)
    logits = torch.einsum("shgd,hnd->shgn", q, keys.float()) * scale
    if s > 1:
        future = torch.arange(n)[None, :] > torch.arange(n - s, n)[:, None]  # (S, N)
        logits = logits.masked_fill(future.to(logits.device)[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=0).mean(dim=1)
