"""Turn a request's copied KV pages and captured queries into compacted store chunks.

Engine-free (torch + lmcompact only), so the worker can run it on a background thread and
unit tests can run it without vLLM. One save job covers chunks ``first_chunk ..`` of a
prompt. The captured queries are the observation window (the prompt's last ``window``
queries: SnapKV's mass, TOVA's rows) and, for ``kvzip`` and ``expected_attention``, a
sample across the whole prompt (:meth:`CompactionPolicy.context_queries`; Expected
Attention takes its query statistics from the window and the sample);
both are scored against every key of the span (window mass in O(W x chunk) memory,
context scores in O(Hq x 128 x T), never S x T)::

    prompt     |<- loaded from store ->|<- chunk f ->|<- chunk f+1 ->|<- tail ->|
    pages                              [.............................. ........]
    sampled                               q     q     q     q     q     q
    window                                                          [ q q q q ]
    each chunk: policy.plan(keys, values, scores sliced to the chunk) -> kept rows

Chunk-local budgets (kept on purpose): every chunk keeps the same K of its C tokens per
(layer, head), chosen by scores that were computed over the whole span (queries from
the whole prompt, softmax over every key of the span). A global top-k across chunks
would give each chunk its own count; the store needs a fixed count per chunk: a later
request may hit any prefix of the chunks, and its load packs ``n * K`` slots and cuts
a hole of ``n * (C - K)`` tokens computed from ``n`` alone (``SchedulerHalf._start``,
``_problem`` rejects other counts). The uniform budget also guarantees coverage: no
stretch of a stored context is emptied, which matters when the questions that will
reuse it are unknown. Inside a chunk a policy may still rank across layers and heads
(kvzip's ``allocation="global"``: a global top-k projected onto the one count,
:mod:`lmcompact.policies.allocation`). With ``store.per_head`` (``cap``) the count may differ
per (layer, head) within a chunk, up to the cap, the chunk's total staying ``L x H x K`` for
kvzip's ``allocation="ragged"``; a load then reserves ``n * cap`` slots per head. Keys
loaded from the store before the span are not scored (not in the copied pages): their
share of each query's softmax is missing, a constant factor per query that changes the
max aggregation little. Candidates carry absolute
positions (``start + i``), so sinks are the prompt's first tokens, not each chunk's. A
policy whose scores depend on every key scored together (``ScorePolicy.span_scores``:
Expected Attention's softmax) is scored once over the whole span and each chunk planned
from its slice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lmcompact.attention.rope import Rope
from lmcompact.attention.scores import context_scores, window_scores
from lmcompact.kernels import dispatch as kernels
from lmcompact.policies import CompactionInputs, CompactionPolicy, LayerObservation, Need
from lmcompact.policies.base import ScorePolicy
from lmcompact.store import ChunkKey, CompactedChunk
from lmcompact.store.transfer import PendingCopy
from lmcompact.vllm.chunks import (
    EngineShape,
    build_chunk,
    chunk_problem,
    full_nbytes,
    uniform_keep,
)
from lmcompact.vllm.kv_layout import PageLayout

logger = logging.getLogger(__name__)

__all__ = [
    "SCORE_NEEDS",
    "EngineShape",
    "SaveJob",
    "build_chunk",
    "chunk_problem",
    "compact_job",
    "full_nbytes",
    "observe_context",
    "observe_layer",
    "uniform_keep",
    "window_masses",
]


SCORE_NEEDS = Need.WINDOW_SCORES | Need.WINDOW_ATTENTION


@dataclass
class SaveJob:
    """Everything needed to compact and store part of one prompt (copies, not views).

    Attributes:
        req_id: vLLM request id (for logs).
        keys: store keys of the chunks to save, in order.
        start: first token of the span (``first_chunk * chunk_size``).
        num_tokens: tokens of the span present in ``pages`` (chunks plus the unsaved tail).
        pages: per layer ``(n_blocks, H, block_size, 2 * D)`` page copies from ``start``.
        queries: per layer ``(S, Hq, D)`` post-RoPE captured queries, or None.
        query_positions: ``(S,)`` absolute positions of the captured queries, or None.
        scale: attention softmax scale of the model.
        window: the last ``window`` prompt positions form the observation window; None
            means every captured query is in it.
        rope: the model's RoPE when known (Expected Attention rotates with it).
        context_scores: per layer ``(H, num_tokens)`` context scores computed elsewhere
            (a reconstruction pass, ``lmcompact/vllm/reconstruct.py``); they replace the
            scores of the captured sample. None: computed here from ``queries``.
        copied: on CUDA, the side-stream copy that fills ``pages`` and ``queries`` (pinned
            host tensors); :meth:`wait_for_copies` before reading them. None: they are
            ready (the CPU engine's pages are host tensors already).
        window_mass: per layer ``(H, num_tokens)`` window scores computed where the pages
            were (:func:`window_masses`, on the GPU at copy time); None: computed here.
    """

    req_id: str
    keys: list[ChunkKey]
    start: int
    num_tokens: int
    pages: list[torch.Tensor]
    queries: list[torch.Tensor] | None
    query_positions: torch.Tensor | None
    scale: float
    window: int | None = None
    rope: Rope | None = None
    context_scores: list[torch.Tensor] | None = None
    copied: PendingCopy | None = None
    window_mass: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the copies this job holds (pages, queries, window scores)."""
        tensors = [*self.pages, *(self.queries or []), *(self.window_mass or [])]
        return sum(t.nbytes for t in tensors)

    def wait_for_copies(self) -> None:
        """Block until ``pages`` and ``queries`` hold their bytes (no-op when ready)."""
        if self.copied is not None:
            self.copied.wait()
            self.copied = None

    @property
    def prompt_len(self) -> int:
        return self.start + self.num_tokens

    def rows(self, policy: CompactionPolicy) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Indices into the captured queries: the window's and the context sample's."""
        if self.query_positions is None:
            return None, None
        positions = self.query_positions
        if self.window is None:
            window = torch.arange(positions.numel())
        else:
            window = torch.nonzero(positions >= self.prompt_len - self.window).flatten()
        sampled = policy.context_queries(self.prompt_len)
        context = None
        if sampled is not None:
            context = torch.nonzero(torch.isin(positions, sampled)).flatten()
        return window, context


def observe_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    start: int,
    needs: Need,
    scale: float,
    kernel_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Window mass ``(H, T)`` and rows ``(H, W, T)`` of one layer, as far as ``needs`` asks.

    Keys on CUDA and no per-query rows asked: the Triton kernel
    (:func:`lmcompact.kernels.dispatch.window_scores`) in ``kernel_dtype`` (the cache dtype,
    so the cast is exact; default the keys' dtype). Otherwise the torch reference, in float32.
    """
    if not needs & SCORE_NEEDS or queries is None or queries.shape[0] == 0:
        return None, None
    assert query_positions is not None
    q = queries.to(keys.device).permute(1, 0, 2).unsqueeze(0)  # (1, Hq, W, D)
    positions = query_positions.to(keys.device) - start
    if not needs & Need.WINDOW_ATTENTION and kernels.use_kernels(keys.device):
        dtype = kernel_dtype or keys.dtype
        mass = kernels.window_scores(
            q.to(dtype).contiguous(),
            keys.unsqueeze(0).to(dtype),
            query_positions=positions,
            scale=scale,
        )
        return mass[0], None
    mass, rows = window_scores(
        q,
        keys.unsqueeze(0),
        query_positions=positions,
        scale=scale,
        chunk_size=1024,
        return_attention=bool(needs & Need.WINDOW_ATTENTION),
    )
    return mass[0], None if rows is None else rows[0]


def window_masses(
    job: SaveJob, layout: PageLayout, policy: CompactionPolicy
) -> list[torch.Tensor] | None:
    """Per layer ``(H, num_tokens)`` float32 window scores of ``job``, computed where its
    pages are (on CUDA: the Triton kernel, a few ms for a 16k prompt, against seconds of
    host time in :func:`compact_job`); None when the policy needs no window scores, or
    needs the window's per-query rows too (those stay with :func:`compact_job`)."""
    needs = policy.needs
    if Need.WINDOW_SCORES not in needs or Need.WINDOW_ATTENTION in needs:
        return None
    if job.queries is None or job.query_positions is None:
        return None
    window, _ = job.rows(policy)
    if window is None or window.numel() == 0:
        return None
    positions = job.query_positions[window]
    masses: list[torch.Tensor] = []
    for pages, queries in zip(job.pages, job.queries, strict=True):
        keys, values = layout.pages_to_tokens(pages)
        n = job.num_tokens
        rows = queries[window.to(queries.device)]
        mass, _ = observe_layer(
            keys[:, :n], values[:, :n], rows, positions, job.start, Need.WINDOW_SCORES, job.scale
        )
        if mass is None:
            return None
        masses.append(mass.float())
    return masses


def observe_context(
    job: SaveJob,
    policy: CompactionPolicy,
    keys: torch.Tensor,
    queries: torch.Tensor | None,
    rows: torch.Tensor | None,
) -> torch.Tensor | None:
    """``(H, T)`` context scores of one layer (max softmax weight over the sampled
    queries, causal) when the policy reads them, else None."""
    if Need.CONTEXT_SCORES not in policy.needs or queries is None or rows is None:
        return None
    if rows.numel() == 0:
        return None
    assert job.query_positions is not None
    q = queries[rows].to(keys.device).permute(1, 0, 2).unsqueeze(0)  # (1, Hq, S, D)
    positions = job.query_positions[rows].to(keys.device) - job.start
    shift = policy.context_shift(job.prompt_len) if job.rope is not None else None
    scores = context_scores(
        q, keys.unsqueeze(0), positions, scale=job.scale, shift=shift, rope=job.rope
    )
    return scores[0]


def compact_job(
    job: SaveJob,
    layout: PageLayout,
    policy: CompactionPolicy,
    chunk_size: int,
    kept_per_chunk: int,
    store_dtype: torch.dtype | None = None,
    recent_layers: frozenset[int] = frozenset(),
    cap: int | None = None,
) -> list[tuple[ChunkKey, CompactedChunk]]:
    """Compact every chunk of ``job``: ``(key, chunk)`` pairs ready for the store.

    Args:
        job: the copied pages and window queries.
        layout: page layout of ``job.pages``.
        policy: the compaction policy.
        chunk_size: tokens per chunk (C).
        kept_per_chunk: tokens every (layer, head) keeps of a chunk (K, block aligned).
        store_dtype: dtype of stored K/V; None keeps the cache dtype.
        recent_layers: sliding-window layers: whatever the policy chose, they keep each
            chunk's last K tokens (:meth:`lmcompact.plan.KeepPlan.with_recent`), so a
            loaded prefix's last chunk sits at logical distances in their window.
        cap: ``store.per_head``: each (layer, head) keeps the plan's own count of a chunk,
            at most ``cap`` (the policy sees it as ``CompactionInputs.max_tokens``); None:
            every (layer, head) keeps ``kept_per_chunk``.
    """
    if kept_per_chunk > chunk_size or kept_per_chunk < 1:
        raise ValueError(f"kept_per_chunk must be in [1, {chunk_size}], got {kept_per_chunk}")
    n_chunks = len(job.keys)
    if job.num_tokens < n_chunks * chunk_size:
        raise ValueError(f"job has {job.num_tokens} tokens, {n_chunks} chunks need more")
    per_layer: list[tuple[torch.Tensor, torch.Tensor]] = []
    observations: list[LayerObservation] = []
    window, context = job.rows(policy)
    window_positions = None
    if window is not None and job.query_positions is not None:
        window_positions = job.query_positions[window]
    # Expected Attention's statistics: the window and the policy's prompt sample
    stats = window if context is None or window is None else torch.cat([window, context]).unique()
    stats_positions = None
    if stats is not None and job.query_positions is not None:
        stats_positions = job.query_positions[stats]
    wants_queries = Need.WINDOW_QUERIES in policy.needs
    for index, pages in enumerate(job.pages):
        keys, values = layout.pages_to_tokens(pages)
        keys, values = keys[:, : job.num_tokens], values[:, : job.num_tokens]
        per_layer.append((keys, values))
        queries = None if job.queries is None else job.queries[index]
        window_queries = None if queries is None or window is None else queries[window]
        stats_queries = None if queries is None or stats is None else queries[stats]
        mass: torch.Tensor | None
        rows: torch.Tensor | None
        if job.window_mass is not None:
            mass, rows = job.window_mass[index], None
        else:
            mass, rows = observe_layer(
                keys, values, window_queries, window_positions, job.start, policy.needs, job.scale
            )
        observations.append(
            LayerObservation(
                window_scores=mass,
                window_attention=rows,
                context_scores=(
                    observe_context(job, policy, keys, queries, context)
                    if job.context_scores is None
                    else job.context_scores[index]
                ),
                window_queries=(
                    stats_queries.permute(1, 0, 2)
                    if wants_queries and stats_queries is not None
                    else None
                ),
            )
        )
    heads = per_layer[0][0].shape[0]

    def span_inputs(lo: int, hi: int) -> CompactionInputs:
        """The policy's inputs for tokens ``[lo, hi)`` of the span."""
        layers = [
            LayerObservation(
                keys=k[:, lo:hi],
                values=v[:, lo:hi],
                window_scores=None if obs.window_scores is None else obs.window_scores[:, lo:hi],
                window_attention=(
                    None if obs.window_attention is None else obs.window_attention[:, :, lo:hi]
                ),
                context_scores=(
                    None if obs.context_scores is None else obs.context_scores[:, lo:hi]
                ),
                window_queries=obs.window_queries,
            )
            for (k, v), obs in zip(per_layer, observations, strict=True)
        ]
        return CompactionInputs(
            hi - lo,
            heads,
            layers,
            positions=torch.arange(job.start + lo, job.start + hi).expand(heads, -1),
            budget_tokens=kept_per_chunk,
            max_tokens=cap,
            query_positions=stats_positions if wants_queries else window_positions,
            rope=job.rope,
            attention_scale=job.scale,
        )

    compacts = kept_per_chunk < chunk_size
    span: list[torch.Tensor] | None = None
    scorer = policy if isinstance(policy, ScorePolicy) and policy.span_scores else None
    if compacts and scorer is not None:
        whole = span_inputs(0, job.num_tokens)
        scorer.check_inputs(whole)
        span = scorer.score_all(whole)  # one softmax over the whole span (Expected Attention)
    out: list[tuple[ChunkKey, CompactedChunk]] = []
    for c, key in enumerate(job.keys):
        lo, hi = c * chunk_size, (c + 1) * chunk_size
        inputs = span_inputs(lo, hi)
        plan = None
        if span is not None and scorer is not None:
            plan = scorer.plan_scored(inputs, [scores[:, lo:hi] for scores in span])
        elif compacts:
            plan = policy.plan(inputs)
        if plan is not None:
            plan = plan.with_recent(recent_layers, kept_per_chunk)
        out.append(
            (key, build_chunk(per_layer, lo, chunk_size, plan, kept_per_chunk, store_dtype, cap))
        )
    return out
