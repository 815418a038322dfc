"""The connector's save path on CUDA: pages go to pinned host memory on a side stream, the
forward pass's stream is not held up, and the save job reads them only after the copy
(skipped without a GPU; the CPU path is in tests/unit/vllm_connector/test_save_to_host.py)."""

from __future__ import annotations

import time

import pytest
import torch

from connectors.vllm.worker import Worker
from lmcompact.compaction.save_job import SaveJob
from lmcompact.store.pinned_pool import PinnedBufferPool
from lmcompact.store.transfer import CopierPool
from tests.gpu.test_store_transfer import sleep_cycles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def saver() -> Worker:
    half = Worker.__new__(Worker)  # only the copy helper (Worker._to_host) is exercised
    half._save_copiers = CopierPool()
    half._host_pool = PinnedBufferPool()
    return half


def test_save_copies_do_not_stall_and_job_waits_for_them() -> None:
    half = saver()
    kv = torch.zeros(16, 2, 32, 128, dtype=torch.bfloat16, device="cuda")
    index = torch.tensor([5, 2, 9], device="cuda")
    host_query = torch.ones(4, 2, 128)
    # rounds after the first are checked: kernels are loaded and torch's pinned-memory cache
    # holds the first round's buffers (a fresh pinned allocation, cudaHostAlloc, makes the
    # device synchronize: CUDA's implicit synchronization rules)
    for round_ in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles())
        kv.fill_(2.5)  # written after the sleep, on the forward's stream
        gathered = kv[index]
        query = kv[0, :, :4].float().transpose(0, 1)  # (4, 2, 128) on the device
        start = time.perf_counter()
        host, copied = half._to_host([gathered, query, host_query])
        queued = time.perf_counter() - start
        if round_ > 0:
            assert not torch.cuda.current_stream().query(), "the copy waited for the producer"
            assert queued < 0.05
        assert copied is not None
        job = SaveJob("r", [], 0, 96, host[:1], host[1:], None, 1.0, copied=copied)
        job.wait_for_copies()
        assert job.copied is None and host[0].is_pinned() and host[0].device.type == "cpu"
        assert bool((host[0] == 2.5).all()) and bool((host[1] == 2.5).all())
        assert host[2] is host_query  # host tensors are passed through
        kv.zero_()
        del host, job  # a saver drops its host copies once encoded: the buffers are reused


def test_window_masses_on_the_gpu_match_the_host_reference() -> None:
    """The save path computes window scores on the GPU (Triton kernel, bf16 inputs) at
    copy time; they agree with the float32 host reference the job would compute."""
    from lmcompact.compaction.page_layout import make_layout
    from lmcompact.compaction.save_job import window_masses
    from lmcompact.policies import make_policy

    torch.manual_seed(0)
    bs, h, d, t, w = 32, 4, 128, 1024, 32
    layout = make_layout("token_major", bs)
    pages = [
        layout.tokens_to_pages(torch.randn(h, t, d), torch.randn(h, t, d)).to(torch.bfloat16)
        for _ in range(2)
    ]
    queries = [torch.randn(w, 2 * h, d) for _ in range(2)]
    positions = torch.arange(t - w, t)
    policy = make_policy("snapkv", budget=0.25)

    def job(device: str) -> SaveJob:
        return SaveJob(
            "r",
            [],
            0,
            t,
            [p.to(device) for p in pages],
            [q.to(device) for q in queries],
            positions,
            d**-0.5,
            window=w,
        )

    on_gpu = window_masses(job("cuda"), layout, policy)
    on_host = window_masses(job("cpu"), layout, policy)
    assert on_gpu is not None and on_host is not None
    for got, want in zip(on_gpu, on_host, strict=True):
        assert got.is_cuda and got.shape == want.shape == (h, t)
        torch.testing.assert_close(got.cpu(), want, rtol=3e-2, atol=1e-3)


def test_reserved_pool_buffers_serve_the_first_saves_after_graph_capture() -> None:
    """``store.warm_up``: buffers reserved in the worker's :class:`PinnedBufferPool` serve
    copies to the host of sizes in the reserved power-of-two classes with no new pinned
    allocation, even after a CUDA graph capture emptied torch's own host cache (torch's
    graph capture calls ``torch.accelerator.empty_host_cache()``: a warm-up through that
    cache was gone before vLLM served its first request)."""
    layers, per_token = 4, 8 * 256 * 2  # 8 KV heads, K and V of 128, bf16
    copier = CopierPool().for_copy(torch.device("cuda"), torch.device("cpu"))
    assert copier is not None
    pool = PinnedBufferPool()
    size = 1 << 20  # a 256-token span at 4 KiB per token
    while size <= 1 << 24:
        pool.reserve(size, layers)
        size *= 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # what vLLM's start-up capture does to torch's cache
        torch.ones(8, device="cuda").mul_(2)
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    reserved = pool.allocations
    for tokens in (256, 768, 3000, 4096):  # classes 1, 4, 16 and 16 MiB
        pages = [torch.ones(tokens * per_token // 2, dtype=torch.bfloat16, device="cuda")]
        host, pending = copier.to_host(pages * layers, pool)
        pending.wait()
        assert all(bool((h == 1).all()) and h.is_pinned() for h in host)
        del host
    assert pool.allocations == reserved
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == before
