"""The worker's save path without CUDA: page copies are host tensors already, nothing
is pending (the CUDA side-stream path is in tests/gpu/test_save_copies.py)."""

from __future__ import annotations

import torch

from connectors.vllm.worker import Worker
from lmcompact.compaction.save_job import SaveJob
from tests.unit.vllm_connector import fakes


def test_host_tensors_pass_through_and_nothing_is_pending() -> None:
    spec = fakes.spec({"policy": "snapkv", "budget": 0.5, "store": {"chunk_size": 64}})
    worker = Worker(spec, None, fakes.stores(spec)[0])
    pages = torch.arange(24.0).view(2, 3, 4)
    host, copied = worker._to_host([pages])
    assert copied is None and host[0] is pages and len(worker._save_copiers) == 0
    worker.shutdown()
    job = SaveJob("r", [], 0, 8, host, None, None, 1.0)
    job.wait_for_copies()  # a no-op without a pending copy
    assert job.pages[0] is pages
