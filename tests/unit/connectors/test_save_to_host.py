"""The save path's host copies without CUDA: page copies are host tensors already, nothing
is pending (the CUDA side-stream path is in tests/gpu/test_save_copies.py)."""

from __future__ import annotations

import torch

from lmcompact.store.transfer import CopierPool
from lmcompact.vllm.compaction import SaveJob
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
