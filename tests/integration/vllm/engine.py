"""Helpers to run a real in-process vLLM CPU engine with and without the connector."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK_SIZE = 32


def transfer_config(
    extra: Mapping[str, Any],
    connector: str = "LMCompactConnector",
    module_path: str | None = None,
) -> Any:
    from connectors.offline import transfer_config as build

    return build(extra, connector, module_path)


@contextmanager
def engine(
    model: str,
    extra: Mapping[str, Any] | None,
    *,
    max_model_len: int = 4096,
    prefix_caching: bool = False,
) -> Iterator[Any]:
    """An ``LLM`` in float32 on the CPU; ``extra`` None runs without the connector."""
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if extra is not None:
        kwargs["kv_transfer_config"] = transfer_config(extra)
    llm = LLM(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        enforce_eager=True,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=max_model_len,
        seed=0,
        **kwargs,
    )
    try:
        yield llm
    finally:
        connector = worker_connector()
        if connector is not None:
            connector.worker_half.drain()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def worker_connector() -> Any:
    """The in-process worker-side connector, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def greedy(llm: Any, prompt_ids: list[int], max_tokens: int = 16) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)
