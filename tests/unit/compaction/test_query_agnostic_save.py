"""The save path with query-agnostic policies: sampled queries and window queries in a job."""

from __future__ import annotations

import pytest
import torch

from lmcompact.attention.rope import Rope
from lmcompact.attention.scores import context_scores
from lmcompact.compaction.page_layout import CpuPageLayout
from lmcompact.compaction.save_job import SaveJob, compact_job
from lmcompact.policies import CompactionInputs, LayerObservation, make_policy
from lmcompact.policies.budget import Budget
from lmcompact.policies.expected_attention import ExpectedAttention
from lmcompact.store import ChunkKeyer, StoreNamespace

BS, H, D, LAYERS, CHUNK = 32, 2, 16, 2, 64
NEEDLE = 64 + 21  # in the second chunk


def _job(queries: list[torch.Tensor], positions: torch.Tensor, window: int, **kw: object):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(0)
    layout = CpuPageLayout(BS)
    keys = [torch.randn(H, 3 * BS * 2, D, generator=generator) * 0.05 for _ in range(LAYERS)]
    for k in keys:
        k[:, NEEDLE] = torch.nn.functional.normalize(torch.ones(D), dim=0)
    values = [torch.randn(H, 3 * BS * 2, D, generator=generator) for _ in range(LAYERS)]
    pages = [layout.tokens_to_pages(k, v) for k, v in zip(keys, values, strict=True)]
    chunk_keys = ChunkKeyer(StoreNamespace("m", "float32", "rows"), CHUNK).keys(list(range(192)))
    job = SaveJob("r", chunk_keys, 0, 192, pages, queries, positions, D**-0.5, window=window, **kw)  # type: ignore[arg-type]
    return job, layout, keys


def test_kvzip_job_scores_with_the_sampled_queries_and_keeps_the_needle() -> None:
    policy = make_policy("kvzip", budget=0.25, n_sink=2, window=8, max_queries=64, kernel_size=1)
    positions = policy.context_queries(192)
    assert positions is not None and 32 < positions.numel() <= 64
    generator = torch.Generator().manual_seed(1)
    n = positions.numel()
    queries = [torch.randn(n, 2 * H, D, generator=generator) * 0.05 for _ in range(LAYERS)]
    reader = int(torch.nonzero(positions > 150)[0])  # a sampled query long after the needle
    for q in queries:
        q[reader] = torch.nn.functional.normalize(torch.ones(D), dim=0) * 40.0
    job, layout, keys = _job(queries, positions, window=8)
    chunks = compact_job(job, layout, policy, CHUNK, 16)
    assert len(chunks) == 3
    for c, (_, chunk) in enumerate(chunks):
        assert chunk.uniform_count() == 16
        for layer in range(LAYERS):
            for head in range(H):
                _, _, kept = chunk.head(layer, head)
                absolute = (kept.long() + c * CHUNK).tolist()
                if c == 0:
                    assert absolute[:2] == [0, 1]  # the prompt's sinks, not each chunk's
                if c == 1:
                    assert NEEDLE in absolute
                    # scores over the whole span: the chunk keeps its top 16 of them
                    full = context_scores(
                        queries[layer].permute(1, 0, 2)[None], keys[layer][None], positions
                    )[0, head, 64:128]
                    best = set(torch.topk(full.double(), 16).indices.tolist())
                    assert best == set(kept.tolist())


def test_expected_attention_job_reads_the_window_queries_only() -> None:
    """Captured rows hold a sample and the window; with ``queries="window"`` the
    statistics come from the window."""
    policy = make_policy(
        "expected_attention", budget=0.25, n_sink=0, n_future_positions=16, queries="window"
    )
    positions = torch.cat([torch.arange(0, 160, 10), torch.arange(184, 192)])
    generator = torch.Generator().manual_seed(2)
    direction = torch.nn.functional.normalize(torch.ones(D), dim=0)
    queries = []
    for _ in range(LAYERS):
        q = torch.randn(positions.numel(), 2 * H, D, generator=generator)
        q[-8:] = direction * 6.0 + 0.01 * q[-8:]  # the window looks along ``direction``
        queries.append(q)
    job, layout, _ = _job(queries, positions, window=8)
    chunks = compact_job(job, layout, policy, CHUNK, 16)
    _, second = chunks[1]
    for layer in range(LAYERS):
        for head in range(H):
            assert NEEDLE - CHUNK in second.head(layer, head)[2].tolist()
    rotated, _, _ = _job(queries, positions, window=8, rope=Rope.from_theta(1e6, D))
    assert len(compact_job(rotated, layout, policy, CHUNK, 16)) == 3


@pytest.mark.parametrize("source", ["prompt", "window"])
def test_expected_attention_job_statistics_from_the_prompt_sample(source: str) -> None:
    """Sampled prompt queries read along ``a``, the window's along ``b``; one token kept
    per chunk: the prompt's statistics keep the ``a`` key, the window's the ``b`` key."""
    policy = make_policy(
        "expected_attention",
        budget=0.25,
        n_sink=0,
        use_covariance=False,
        use_vnorm=False,
        queries=source,
        max_queries=64,
    )
    sampled = policy.context_queries(192) if source == "prompt" else None
    window = torch.arange(184, 192)
    positions = window if sampled is None else torch.cat([sampled, window]).unique()
    a, b = torch.zeros(D), torch.zeros(D)
    a[0], b[1] = 1.0, 1.0
    at_a, at_b = 64 + 21, 64 + 40  # both in the second chunk
    generator = torch.Generator().manual_seed(4)
    layout = CpuPageLayout(BS)
    keys = [torch.randn(H, 192, D, generator=generator) * 0.01 for _ in range(LAYERS)]
    values = [torch.randn(H, 192, D, generator=generator) for _ in range(LAYERS)]
    queries = []
    for k in keys:
        k[:, at_a], k[:, at_b] = a, b
        q = torch.randn(positions.numel(), 2 * H, D, generator=generator) * 0.01
        q[positions < 160] += a * 6.0
        q[positions >= 184] += b * 6.0
        queries.append(q)
    pages = [layout.tokens_to_pages(k, v) for k, v in zip(keys, values, strict=True)]
    chunk_keys = ChunkKeyer(StoreNamespace("m", "float32", "rows"), CHUNK).keys(list(range(192)))
    job = SaveJob("r", chunk_keys, 0, 192, pages, queries, positions, D**-0.5, window=8)
    _, second = compact_job(job, layout, policy, CHUNK, 1)[1]
    expected = (at_a if source == "prompt" else at_b) - CHUNK
    for layer in range(LAYERS):
        for head in range(H):
            assert second.head(layer, head)[2].tolist() == [expected]


def test_expected_attention_chunks_rank_by_the_whole_span() -> None:
    """Each chunk keeps the top of its slice of the scores computed over the whole span
    (one softmax per query head over every key), not of scores normalized per chunk."""
    policy = ExpectedAttention(Budget(ratio=0.25), n_sink=2, n_future_positions=16, max_queries=64)
    sampled = policy.context_queries(192)
    assert sampled is not None
    positions = torch.cat([sampled, torch.arange(184, 192)]).unique()
    generator = torch.Generator().manual_seed(5)
    queries = [torch.randn(positions.numel(), 2 * H, D, generator=generator) for _ in range(LAYERS)]
    for q in queries:
        q[:, 0] *= 4.0  # the two query heads of a group differ in how peaked they are
    job, layout, keys = _job(queries, positions, window=8)
    for k in keys:  # keys of the last chunk read strongly by the peaked head
        k[:, 128:] *= 3.0
    job.pages = [
        layout.tokens_to_pages(k, layout.pages_to_tokens(p)[1])
        for k, p in zip(keys, job.pages, strict=True)
    ]
    chunks = compact_job(job, layout, policy, CHUNK, 8)
    whole = CompactionInputs(
        192,
        H,
        [
            LayerObservation(
                keys=k,
                values=layout.pages_to_tokens(p)[1][:, :192],
                window_queries=q.permute(1, 0, 2),
            )
            for k, p, q in zip(keys, job.pages, queries, strict=True)
        ],
        query_positions=positions,
        attention_scale=job.scale,
    )
    span = policy.score_all(whole)
    per_chunk_differs = False
    for c, (_, chunk) in enumerate(chunks):
        lo = c * CHUNK
        alone = policy.score_all(
            CompactionInputs(
                CHUNK,
                H,
                [
                    LayerObservation(
                        keys=k[:, lo : lo + CHUNK],
                        values=layout.pages_to_tokens(p)[1][:, lo : lo + CHUNK],
                        window_queries=q.permute(1, 0, 2),
                    )
                    for k, p, q in zip(keys, job.pages, queries, strict=True)
                ],
                positions=torch.arange(lo, lo + CHUNK).expand(H, -1),
                query_positions=positions,
                attention_scale=job.scale,
            )
        )
        for layer in range(LAYERS):
            for head in range(H):
                kept = set(chunk.head(layer, head)[2].tolist())
                best = torch.topk(span[layer][head, lo : lo + CHUNK], 8).indices.tolist()
                assert kept == set(best)
                own = set(torch.topk(alone[layer][head], 8).indices.tolist())
                per_chunk_differs |= own != kept
    assert per_chunk_differs  # the test would catch per-chunk normalization
