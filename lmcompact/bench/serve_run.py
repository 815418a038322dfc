"""One serving run as users run vLLM: default batching, CUDA graphs, requests at once.

Used by ``lmcompact bench serve`` (one engine per subprocess). ``num_requests`` prompts of
``prompt_tokens`` seeded random token ids arrive at once; each generates exactly
``output_tokens`` (EOS ignored). The engine keeps vLLM's defaults for batching
(``max_num_batched_tokens``, ``max_num_seqs``) and compilation (CUDA graphs on CUDA; the
CPU build runs eagerly); the KV pool is fixed by ``num_blocks`` or sized by
``gpu_memory_utilization``. The loop records per engine step the running requests, the
tokens scheduled, whether the step only decoded, and its wall time.

With ``tensor_parallel_size`` > 1 the engine core (and the connector's scheduler half)
stays in this process and each rank runs in a worker process (vLLM's ``mp`` executor); pack
timings are then read from every rank through ``LLM.collective_rpc`` (rank 0's in the
figures, every rank's p50 beside them). On the CPU each rank is bound to its share of this
process's CPUs (``VLLM_CPU_OMP_THREADS_BIND``, unless set).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ServeWorkload:
    """Settings of one serving run.

    Attributes:
        model: model folder (config.json; weights unless ``load_format="dummy"``).
        prompt_tokens: tokens per prompt.
        output_tokens: tokens generated per request.
        num_requests: requests sent at once.
        block_size: tokens per KV block.
        num_blocks: KV pool in blocks (null block included), or None to size the pool by
            ``gpu_memory_utilization``.
        gpu_memory_utilization: vLLM's memory fraction (used when ``num_blocks`` is None).
        dtype: model and KV dtype.
        load_format: vLLM load format (``"dummy"``: random weights of the model's shape).
        enforce_eager: True turns CUDA graphs off (the CPU build is always eager).
        seed: prompt token ids.
        tensor_parallel_size: ranks the model is split across (KV heads divide by it).
    """

    model: str
    prompt_tokens: int
    output_tokens: int
    num_requests: int
    block_size: int = 32
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "bfloat16"
    load_format: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1


def prompts(workload: ServeWorkload) -> list[list[int]]:
    """Seeded random token ids (special ids below 10 avoided), the same for every run."""
    vocab = int(json.loads((Path(workload.model) / "config.json").read_text())["vocab_size"])
    rng = random.Random(workload.seed)
    return [
        [rng.randrange(10, vocab - 10) for _ in range(workload.prompt_tokens)]
        for _ in range(workload.num_requests)
    ]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_serve(workload: ServeWorkload, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Serve the workload once; ``extra`` None is plain vLLM (no connector)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm import SamplingParams

    from connectors.vllm.offline import build_llm

    on_cuda = torch.cuda.is_available()
    tp = workload.tensor_parallel_size
    if not on_cuda:  # vllm-cpu: a small fixed KV space, one thread per process
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if tp > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tp))
    kwargs: dict[str, Any] = {}
    if on_cuda:
        kwargs["gpu_memory_utilization"] = workload.gpu_memory_utilization
    eager = workload.enforce_eager or not on_cuda
    began = time.perf_counter()
    llm = build_llm(  # the one engine recipe, with vLLM's own batching (engine=...)
        workload.model,
        extra,
        dtype=workload.dtype,
        block_size=workload.block_size,
        max_model_len=workload.prompt_tokens + workload.output_tokens + workload.block_size,
        num_blocks=workload.num_blocks,
        enforce_eager=eager,
        load_format=workload.load_format,
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        engine={"max_num_batched_tokens": None},
        **kwargs,
    )
    init_s = time.perf_counter() - began
    engine: Any = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool_blocks = int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
    params = SamplingParams(
        temperature=0.0, max_tokens=workload.output_tokens, ignore_eos=True, detokenize=False
    )
    for i, ids in enumerate(prompts(workload)):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)

    running: list[int] = []
    scheduled: list[int] = []
    decode_only: list[bool] = []
    preempted: list[str] = []
    original_schedule = scheduler.schedule
    original_preempt = getattr(scheduler, "_preempt_request", None)

    def schedule(*args: Any, **kw: Any) -> Any:
        output = original_schedule(*args, **kw)
        counts = list(output.num_scheduled_tokens.values())
        scheduled.append(sum(counts))
        decode_only.append(bool(counts) and all(c == 1 for c in counts))
        running.append(len(scheduler.running))
        return output

    def preempt(request: Any, *args: Any, **kw: Any) -> Any:
        preempted.append(request.request_id)
        assert original_preempt is not None
        return original_preempt(request, *args, **kw)

    scheduler.schedule = schedule
    if original_preempt is not None:
        scheduler._preempt_request = preempt
    step_s: list[float] = []
    done = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        step_began = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - step_began)
        done += sum(1 for out in outputs if out.finished)
    wall = time.perf_counter() - t0
    scheduler.schedule = original_schedule
    end_free = int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
    memory = _connector_figures(scheduler, llm if tp > 1 else None)
    engine.engine_core.shutdown()

    n = min(len(step_s), len(decode_only))
    decode_steps = [i for i in range(n) if decode_only[i]]
    decode_tokens = sum(scheduled[i] for i in decode_steps)
    decode_time = sum(step_s[i] for i in decode_steps)
    total_out = workload.num_requests * workload.output_tokens
    return {
        "workload": asdict(workload),
        "extra": dict(extra) if extra is not None else None,
        "cuda_graphs": not eager,
        "engine_init_s": init_s,
        "pool_blocks": pool_blocks,
        "wall_s": wall,
        "output_tokens_per_s": total_out / wall,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
        "peak_running": max(running, default=0),
        "mean_running": statistics.fmean(running) if running else 0.0,
        "mean_running_decode": statistics.fmean(running[i] for i in decode_steps)
        if decode_steps
        else 0.0,
        "steps": len(step_s),
        "decode_only_steps": len(decode_steps),
        "finished": done,
        "preemptions": len(preempted),
        "preempted_requests": len(set(preempted)),
        "pool_balanced": end_free == pool_blocks,
        "memory": memory,
        "trace": {"running": running, "step_s": [round(s, 5) for s in step_s]},
    }


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` splitting this process's CPUs evenly across ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // ranks
    if share < 1:
        raise ValueError(f"tensor_parallel_size {ranks} on the CPU needs {ranks} CPUs, got {cpus}")
    return "|".join(
        ",".join(str(c) for c in cpus[r * share : (r + 1) * share]) for r in range(ranks)
    )


def _rank_pack_figures(worker: Any) -> dict[str, Any]:
    """Run on each worker (``LLM.collective_rpc``): its connector's pack figures."""
    from connectors.vllm.offline import worker_connector

    release: Any = worker_connector().worker  # the worker side of this rank
    return {
        "timings": release.pack_timings(),
        "device_packs": int(release.pack_stats["device_packs"]),
        "unscored": int(release.pack_stats["unscored"]),
        "warm_up_s": [list(x) for x in release.warm_up_s],
    }


def _connector_figures(scheduler: Any, llm: Any = None) -> dict[str, Any] | None:
    """Pack counts and timings of the release group: the in-process worker's, or with
    ``llm`` (tensor parallel) every rank's through ``collective_rpc``."""
    connector = getattr(scheduler, "connector", None)
    memory = getattr(connector, "scheduler", None)
    if memory is None or memory.planner is None:
        return None
    # in-process: the worker-side connector here; tensor parallel: every rank's
    ranks = [_rank_pack_figures(None)] if llm is None else llm.collective_rpc(_rank_pack_figures)
    stats = memory.release_stats
    first = ranks[0]
    timings = first["timings"]
    device, host = timings["device"], timings["host"]
    return {
        "packs": stats.packs,
        "repacks": stats.repacks,
        "preemptions_seen": stats.preemptions,
        "admissions_deferred": stats.admissions_deferred,
        "blocks_released": stats.blocks_released,
        "device_packs": first["device_packs"],
        "unscored_packs": first["unscored"],
        "pack_ms_p50": percentile(device, 0.5),
        "pack_ms_p99": percentile(device, 0.99),
        "pack_ms_first": device[0] if device else 0.0,
        "pack_host_ms_p50": percentile(host, 0.5),
        "pack_host_ms_first": host[0] if host else 0.0,
        "pack_s_total": sum(host) / 1e3,
        "pack_ms": [round(x, 3) for x in device],
        "warm_up_s": first["warm_up_s"],
        "pack_ms_p50_per_rank": [percentile(r["timings"]["device"], 0.5) for r in ranks],
    }
