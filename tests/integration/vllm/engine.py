"""Helpers to run a real in-process vLLM CPU engine with and without the connector."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from connectors.vllm.offline import worker_connector  # imports no vLLM: the environment below wins

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

__all__ = ["BLOCK_SIZE", "engine", "greedy", "transfer_config", "worker_connector"]

BLOCK_SIZE = 32


def transfer_config(
    extra: Mapping[str, Any],
    connector: str = "LMCompactConnector",
    module_path: str | None = None,
) -> Any:
    from connectors.vllm.offline import transfer_config as build

    return build(extra, connector, module_path)


@contextmanager
def engine(
    model: str,
    extra: Mapping[str, Any] | None,
    *,
    max_model_len: int = 4096,
    prefix_caching: bool = False,
) -> Iterator[Any]:
    """An ``LLM`` in float32 on the CPU (:func:`connectors.vllm.offline.engine`, the one engine
    builder); ``extra`` None runs without the connector."""
    from connectors.vllm.offline import engine as offline_engine

    with offline_engine(
        model,
        extra,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        prefix_caching=prefix_caching,
    ) as llm:
        yield llm


def greedy(llm: Any, prompt_ids: list[int], max_tokens: int = 16) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)
