"""The save path without CUDA: page copies are host tensors already, nothing
is pending (the CUDA side-stream path is in tests/gpu/test_save_copies.py)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.policies import Need, make_policy
from lmcompact.store import ChunkKeyer, StoreNamespace
from lmcompact.store.transfer import CopierPool
from lmcompact.vllm.compaction import SaveJob, compact_job, window_masses
from lmcompact.vllm.kv_layout import CpuPageLayout
from lmcompact.vllm.worker_save import ChunkSaving


def test_host_tensors_pass_through_and_nothing_is_pending() -> None:
    half = ChunkSaving.__new__(ChunkSaving)
    half._save_copiers = CopierPool()
    pages = torch.arange(24.0).view(2, 3, 4)
    host, copied = half._to_host([pages])
    assert copied is None and host[0] is pages and len(half._save_copiers) == 0
    job = SaveJob("r", [], 0, 8, host, None, None, 1.0)
    job.wait_for_copies()  # a no-op without a pending copy
    assert job.pages[0] is pages


def _job(policy_window: int = 8) -> tuple[SaveJob, CpuPageLayout]:
    bs, h, d, layers = 32, 2, 16, 3
    layout = CpuPageLayout(bs)
    torch.manual_seed(0)
    pages = [layout.tokens_to_pages(torch.randn(h, 4 * bs, d), torch.randn(h, 4 * bs, d))]
    pages += [layout.tokens_to_pages(torch.randn(h, 4 * bs, d), torch.randn(h, 4 * bs, d))]
    pages += [layout.tokens_to_pages(torch.randn(h, 4 * bs, d), torch.randn(h, 4 * bs, d))]
    keys = ChunkKeyer(StoreNamespace("m", "float32", "rows"), 128).keys(list(range(4 * bs)))
    queries = [torch.randn(policy_window, 2 * h, d) for _ in range(layers)]
    positions = torch.arange(4 * bs - policy_window, 4 * bs)
    return SaveJob("r", keys, 0, 4 * bs, pages, queries, positions, d**-0.5), layout


@pytest.mark.parametrize("policy", ["snapkv", "tova", "knorm", "streaming_llm", "pyramidkv"])
def test_window_scores_computed_at_copy_time_give_the_same_chunks(policy: str) -> None:
    """The GPU save computes window scores where the pages are (window_masses) and the
    job uses them; with the same arithmetic (here both on the CPU) the chunks are equal."""
    job, layout = _job()
    compaction = make_policy(policy, budget=0.5)
    want = compact_job(job, layout, compaction, 128, 64)
    masses = window_masses(job, layout, compaction)
    needs_scores_only = (
        Need.WINDOW_SCORES in compaction.needs and Need.WINDOW_ATTENTION not in compaction.needs
    )
    assert (masses is not None) == needs_scores_only
    if masses is None:
        return
    assert [m.shape for m in masses] == [(2, job.num_tokens)] * 3
    job.window_mass = masses
    got = compact_job(job, layout, compaction, 128, 64)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
    job.window_mass = [torch.zeros_like(m) for m in masses]  # the masses are what decides
    other = compact_job(job, layout, compaction, 128, 64)
    pairs = zip(other, want, strict=True)
    assert any(not torch.equal(a.positions, b.positions) for (_, a), (_, b) in pairs)
