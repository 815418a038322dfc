"""GPU timings of the kernel benchmark: ``do_bench`` medians, CUDA-graph replays, copy
bandwidth and SDPA baselines (CUDA only; Triton imported when called)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def bench(fn: Any, rep: int = 100) -> float:
    import triton  # type: ignore[import-untyped]

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def bench_graph(fn: Any) -> float | None:
    """Median ms of ``fn`` replayed from a CUDA graph (no Python launch overhead)."""
    import torch

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return bench(graph.replay)
    except Exception as exc:  # graphs are an extra; never fail the run on them
        log.warning("CUDA graph timing failed: %r", exc)
        return None


def copy_bandwidth(nbytes: int) -> dict[str, float]:
    import torch

    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return {"bytes": 2.0 * nbytes, "ms": ms, "GBps": 2.0 * nbytes / ms / 1e6}


def sdpa(q: Any, k: Any, v: Any) -> Any:
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def time_sdpa(q: Any, k: Any, v: Any) -> tuple[float, str]:
    """Median ms of SDPA forward (GQA), on the flash backend when it takes the shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            sdpa(q, k, v)
            return bench(lambda: sdpa(q, k, v)), "flash"
    except RuntimeError as exc:
        log.warning("flash SDPA refused these shapes (%s); timing the default backend", exc)
        return bench(lambda: sdpa(q, k, v)), "default"
