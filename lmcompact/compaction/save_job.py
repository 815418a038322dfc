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
a hole of ``n * (C - K)`` tokens computed from ``n`` alone (the connector scheduler's ``_start``,
``_problem`` rejects other counts). The uniform budget also guarantees coverage: no
stretch of a stored context is emptied, which matters when the questions that will
reuse it are unknown. Inside a chunk a policy may still rank across layers and heads
(kvzip's ``allocation="global"``: a global top-k projected onto the one count,
:mod:`lmcompact.policies.allocation`). With ``store.per_head`` (``cap``) the count may differ
per (layer, head) within a chunk, up to the cap, each layer's heads together up to a layer cap
(the cells a load reserves), the chunk's total staying ``L x H x K`` for kvzip's
``allocation="ragged"``. Keys
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
from lmcompact.compaction.chunks import (
    EngineShape,
    build_chunk,
    chunk_problem,
    full_nbytes,
    uniform_keep,
)
from lmcompact.compaction.kv_quant import Fp8Pages
from lmcompact.compaction.page_layout import PageLayout
from lmcompact.compaction.policy_inputs import (
    SCORE_NEEDS,
    Queries,
    compaction_inputs,
    joined_positions,
    layer_observation,
    score_window,
    slice_candidates,
)
from lmcompact.policies import CompactionInputs, CompactionPolicy, LayerObservation, Need
from lmcompact.policies.base import ScorePolicy
from lmcompact.store import ChunkKey, CompactedChunk
from lmcompact.store.transfer import PendingCopy

logger = logging.getLogger(__name__)

__all__ = [
    "SCORE_NEEDS",
    "EngineShape",
    "SaveJob",
    "build_chunk",
    "chunk_problem",
    "compact_job",
    "full_nbytes",
    "observe_layer",
    "uniform_keep",
    "window_masses",
]


SAVE_CHUNK = 1024
"""Keys per chunk of the save path's reference window scores (memory ``Hq x W x 1024``)."""


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
            (a reconstruction pass, ``connectors/vllm/reconstruct.py``); they replace the
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

    def layer_queries(
        self, index: int, policy: CompactionPolicy
    ) -> tuple[Queries | None, Queries | None]:
        """Layer ``index``'s captured queries, head-major: the window's and the policy's
        context sample's (:meth:`rows`)."""
        if self.queries is None or self.query_positions is None:
            return None, None
        captured = self.queries[index]
        window, context = self.rows(policy)

        def select(rows: torch.Tensor | None) -> Queries | None:
            if rows is None:
                return None
            assert self.query_positions is not None
            picked = captured[rows.to(captured.device)].permute(1, 0, 2)
            return Queries(picked, self.query_positions[rows])

        return select(window), select(context)


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
    """Window mass ``(H, T)`` and rows ``(H, W, T)`` of one layer for captured token-major
    queries ``(W, Hq, D)``, as far as ``needs`` asks (the mass whenever it asks either):
    :func:`lmcompact.compaction.policy_inputs.score_window` as the save path calls it
    (Triton kernel on CUDA in ``kernel_dtype``, default the keys' dtype)."""
    if not needs & SCORE_NEEDS or queries is None or queries.shape[0] == 0:
        return None, None
    assert query_positions is not None
    return score_window(
        keys,
        Queries(queries.permute(1, 0, 2), query_positions),
        scale=scale,
        start=start,
        rows=Need.WINDOW_ATTENTION in needs,
        kernel_dtype=kernel_dtype or keys.dtype,
        chunk_size=SAVE_CHUNK,
    )


def window_masses(
    job: SaveJob, layout: PageLayout, policy: CompactionPolicy, fp8: Fp8Pages | None = None
) -> list[torch.Tensor] | None:
    """Per layer ``(H, num_tokens)`` float32 window scores of ``job``, computed where its
    pages are (on CUDA: the Triton kernel, a few ms for a 16k prompt, against seconds of
    host time in :func:`compact_job`); None when the policy needs no window scores, or
    needs the window's per-query rows too (those stay with :func:`compact_job`). ``fp8``:
    the pages hold fp8 bytes, scored as the numbers they decode to."""
    needs = policy.needs
    if Need.WINDOW_SCORES not in needs or Need.WINDOW_ATTENTION in needs:
        return None
    masses: list[torch.Tensor] = []
    for index, pages in enumerate(job.pages):
        keys, _ = layout.pages_to_tokens(pages)
        if fp8 is not None:
            keys = fp8.keys(index, keys)
        window, _ = job.layer_queries(index, policy)
        if window is None or window.queries.shape[1] == 0:
            return None
        n = job.num_tokens
        obs = layer_observation(
            Need.WINDOW_SCORES,
            keys[:, :n],
            window=window,
            scale=job.scale,
            start=job.start,
            kernel_dtype=keys.dtype,
            chunk_size=SAVE_CHUNK,
        )
        assert obs.window_scores is not None
        masses.append(obs.window_scores.float())
    return masses


def compact_job(
    job: SaveJob,
    layout: PageLayout,
    policy: CompactionPolicy,
    chunk_size: int,
    kept_per_chunk: int,
    store_dtype: torch.dtype | None = None,
    recent_layers: frozenset[int] = frozenset(),
    cap: int | None = None,
    fp8: Fp8Pages | None = None,
    layer_cap: int | None = None,
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
        fp8: the pages hold fp8 bytes: the policy scores the numbers they decode to, and
            the chunks keep the bytes (a load writes back what the engine wrote).
        layer_cap: with ``cap``, most tokens a layer's heads keep of a chunk together (the
            cells a load reserves; ``CompactionInputs.max_layer_tokens``); None: no bound.
    """
    if kept_per_chunk > chunk_size or kept_per_chunk < 1:
        raise ValueError(f"kept_per_chunk must be in [1, {chunk_size}], got {kept_per_chunk}")
    n_chunks = len(job.keys)
    if job.num_tokens < n_chunks * chunk_size:
        raise ValueError(f"job has {job.num_tokens} tokens, {n_chunks} chunks need more")
    needs = policy.needs
    per_layer: list[tuple[torch.Tensor, torch.Tensor]] = []
    observations: list[LayerObservation] = []
    query_positions = None
    shift = policy.context_shift(job.prompt_len)
    for index, pages in enumerate(job.pages):
        keys, values = layout.pages_to_tokens(pages)
        keys, values = keys[:, : job.num_tokens], values[:, : job.num_tokens]
        per_layer.append((keys, values))
        if fp8 is not None:
            keys, values = fp8.keys(index, keys), fp8.values(index, values)
        window, sample = job.layer_queries(index, policy)
        if window is not None:
            query_positions = joined_positions(
                window.positions, None if sample is None else sample.positions
            )
        observations.append(
            layer_observation(
                needs,
                keys,
                values,
                window=window,
                sample=sample,
                observed=LayerObservation(
                    window_scores=None if job.window_mass is None else job.window_mass[index],
                    context_scores=(
                        None if job.context_scores is None else job.context_scores[index]
                    ),
                ),
                scale=job.scale,
                start=job.start,
                context_shift=shift,
                rope=job.rope,
                kernel_dtype=keys.dtype,
                chunk_size=SAVE_CHUNK,
            )
        )
    heads = per_layer[0][0].shape[0]

    def span_inputs(lo: int, hi: int) -> CompactionInputs:
        """The policy's inputs for tokens ``[lo, hi)`` of the span."""
        return compaction_inputs(
            needs,
            [slice_candidates(obs, lo, hi) for obs in observations],
            hi - lo,
            heads,
            positions=torch.arange(job.start + lo, job.start + hi).expand(heads, -1),
            budget_tokens=kept_per_chunk,
            max_tokens=cap,
            max_layer_tokens=layer_cap,
            query_positions=query_positions,
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
        chunk = build_chunk(
            per_layer, lo, chunk_size, plan, kept_per_chunk, store_dtype, cap, layer_cap
        )
        out.append((key, chunk))
    return out
