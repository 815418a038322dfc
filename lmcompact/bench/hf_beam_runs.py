"""The runs behind ``lmcompact bench hf-beam``: caches, timing hooks, the profiler.

One :class:`Setup` per (prompt, config) holds the cache (a PagedCache is
reused by the warm-up and the timed run) and, on CUDA, the decode graph
runner; :func:`one_run` times one ``generate``; :func:`profile_decode`
counts the CUDA calls of decode steps. See :mod:`lmcompact.bench.hf_beam`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


class StepClock:
    """Forward hooks: prefill time, end of every forward, KV bytes after each forward."""

    def __init__(self, model: Any, kv_bytes: Any) -> None:
        import torch

        self.kv_bytes = kv_bytes
        cuda = next(model.parameters()).device.type == "cuda"
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.kv: list[int] = []
        self._handles = [
            model.register_forward_pre_hook(lambda *_: self._mark(self.starts)),
            model.register_forward_hook(self._after),
        ]

    def _mark(self, into: list[float]) -> None:
        self.sync()
        into.append(time.perf_counter())

    def _after(self, *_: Any) -> None:
        self._mark(self.ends)
        self.kv.append(int(self.kv_bytes()))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _dynamic_kv_bytes(cache: Any) -> int:
    total = 0
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += layer.keys.nbytes + layer.values.nbytes
    return total


class Setup:
    """One (prompt, config): the cache (reused by the warm-up and the timed run) and graphs."""

    def __init__(self, model: Any, ids: Any, config: str, args: argparse.Namespace) -> None:
        from transformers import DynamicCache

        from lmcompact.hf.attention import enable_lmcompact_attention
        from lmcompact.hf.paged import PagedCache, blocks_needed
        from lmcompact.hf.paged.graph import DecodeGraphs
        from lmcompact.policies import make_policy

        self.config = config
        self.model = model
        self.graphs: DecodeGraphs | None = None
        self.cache: Any = None
        if config.startswith("dynamic"):
            model.set_attn_implementation("sdpa")
            self._new_dynamic = lambda: DynamicCache(config=model.config)
            return
        enable_lmcompact_attention(model)
        total = ids.shape[1] + args.new_tokens + args.profile
        self.cache = PagedCache(
            model.config,
            num_blocks=blocks_needed(model.config, args.beams, total, args.block_size),
            block_size=args.block_size,
            kv_dtype="int8" if "int8" in config else "auto",
            policy=make_policy(args.policy, budget=args.ratio) if "compact" in config else None,
        )
        if ids.device.type == "cuda" and args.cuda_graphs and config != "paged_eager":
            self.graphs = DecodeGraphs(model)
            self.graphs.install()

    def fresh_cache(self) -> tuple[Any, Any]:
        """The cache for the next generate and its KV byte counter."""
        if self.cache is None:
            cache = self._new_dynamic()
            return cache, lambda: _dynamic_kv_bytes(cache)
        return self.cache, self.cache.kv_bytes

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.remove()


def sdpa_backends(names: str | None) -> Any:
    """A context allowing only ``names`` (comma-separated) as SDPA backends; no-op for None."""
    from contextlib import nullcontext

    if names is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    wanted = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in wanted if n not in SDPA_BACKENDS]
    if bad or not wanted:
        raise ValueError(f"--sdpa-backends must come from {sorted(SDPA_BACKENDS)}; got {names!r}")
    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in wanted])


def generate(model: Any, ids: Any, cache: Any, beams: int, new_tokens: int) -> Any:
    import torch

    with torch.inference_mode():
        return model.generate(
            ids,
            num_beams=beams,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            past_key_values=cache,
            early_stopping=False,
        )


def one_run(
    setup: Setup, ids: Any, args: argparse.Namespace, new_tokens: int | None = None
) -> dict[str, Any]:
    import torch

    new_tokens = args.new_tokens if new_tokens is None else new_tokens
    model = setup.model
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    cache, kv_bytes = setup.fresh_cache()
    captures = setup.graphs.captures if setup.graphs is not None else 0
    clock = StepClock(model, kv_bytes)
    start = time.perf_counter()
    try:
        out = generate(model, ids, cache, args.beams, new_tokens)
    finally:
        clock.remove()
    clock.sync()
    end = time.perf_counter()
    steps = max(new_tokens - 1, 1)
    row: dict[str, Any] = {
        "config": setup.config,
        "prompt_tokens": int(ids.shape[1]),
        "prefill_s": clock.ends[0] - clock.starts[0],
        "decode_s_per_token": (end - clock.ends[0]) / steps,
        "total_s": end - start,
        "peak_kv_bytes": max(clock.kv),
        "final_kv_bytes": clock.kv[-1],
        "tokens": out[0, ids.shape[1] :].tolist(),
    }
    if cuda:
        row["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    if setup.graphs is not None:
        row["graph_captures"] = setup.graphs.captures - captures
        row["graph_failure"] = setup.graphs.failure
    if setup.cache is not None:
        release(cache, row)
    return row


def release(cache: Any, row: dict[str, Any]) -> None:
    """Check exact block accounting, give every block back, record that the pool is whole."""
    row["pool_capacity_bytes"] = cache.kv_bytes(cache.pool.num_blocks)
    cache.check_accounting()
    cache.reset()
    row["pool_back_to_start"] = cache.pool.is_pristine()


PROFILED = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
)


def profile_decode(setup: Setup, ids: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``args.profile`` decode steps under the torch profiler (prefill excluded): per-step calls.

    Returns the CUDA runtime/driver calls per step (:data:`PROFILED`), host
    wall time per step under the profiler, and the ops with the most host
    time per step.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if ids.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    forwards = [0]

    def after_forward(*_: Any) -> None:
        forwards[0] += 1
        if forwards[0] == 1:  # the prefill is done: profile the decode steps
            prof.start()

    cache, _ = setup.fresh_cache()
    handle = setup.model.register_forward_hook(after_forward)
    try:
        start = time.perf_counter()
        generate(setup.model, ids, cache, args.beams, args.profile + 1)
    finally:
        handle.remove()
        prof.stop()
    wall = time.perf_counter() - start
    steps = max(forwards[0] - 1, 1)
    events = prof.key_averages()
    counts = {e.key: e.count for e in events}
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    if setup.cache is not None:
        release(cache, {})
    return {
        "steps": steps,
        "wall_s_per_step_profiled": wall / steps,
        "calls_per_step": {k: counts[k] / steps for k in PROFILED if k in counts},
        "top_self_cpu_us_per_step": [
            [e.key, round(e.self_cpu_time_total / steps, 1), e.count / steps] for e in top
        ],
    }
