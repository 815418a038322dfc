"""Run an in-process vLLM CPU engine with the connector's release group and look inside its
pool.

The connector is ``LMCompactConnector``; its ``"release"`` group is off unless the options
name it, so every test here spells it (``"release": {...}``) in its options.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from tests.integration.vllm.engine import BLOCK_SIZE, transfer_config

__all__ = ["BLOCK_SIZE", "CONNECTOR", "release_engine", "release_transfer_config"]


CONNECTOR = ("LMCompactConnector", "connectors.vllm.connector")


def release_transfer_config(
    extra: Mapping[str, Any], connector: tuple[str, str] = CONNECTOR
) -> Any:
    return transfer_config(extra, *connector)


@contextmanager
def release_engine(
    model: str,
    extra: Mapping[str, Any] | None,
    *,
    num_blocks: int | None = None,
    max_model_len: int = 2048,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    connector: tuple[str, str] = CONNECTOR,
    prefix_caching: bool = False,
    **engine_args: Any,
) -> Iterator[Any]:
    """A float32 ``LLM`` on the CPU; ``extra`` None runs without any connector; other
    ``vllm.LLM`` keywords in ``engine_args`` (e.g. ``logits_processors``).

    Args:
        num_blocks: KV blocks in the pool (``num_gpu_blocks_override``), None for vLLM's
            own sizing.
        connector: ``(class name, module path)`` of the connector (a test subclass keeps
            its own module path).
        prefix_caching: vLLM's ``enable_prefix_caching``.
    """
    from connectors.vllm.offline import engine as offline_engine

    with offline_engine(
        model,
        extra,
        connector=connector[0],
        module_path=connector[1],
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefix_caching=prefix_caching,
        **engine_args,
    ) as llm:
        yield llm


def scheduler(llm: Any) -> Any:
    """The engine core's scheduler (in-process mode only)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def kv_manager(llm: Any) -> Any:
    return scheduler(llm).kv_cache_manager


def held_blocks(llm: Any, req_id: str) -> int:
    """Non-null blocks the request holds now."""
    rows = kv_manager(llm).coordinator.single_type_managers[0].req_to_blocks
    return sum(1 for block in rows.get(req_id, []) if not block.is_null)


def engine_request_ids(llm: Any) -> dict[str, str]:
    """External request id -> engine request id, for requests the scheduler knows."""
    return {rid.rsplit("-", 1)[0]: rid for rid in scheduler(llm).requests}


def kv_layers(llm: Any) -> list[Any]:
    """The worker's paged KV tensors, one per layer."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return list(get_kv_transfer_group().worker.kv_caches.values())


StepHook = Callable[[int, list[Any]], None]


def run(
    llm: Any,
    prompts: Mapping[str, list[int]],
    max_tokens: int | Mapping[str, int],
    on_step: StepHook | None = None,
) -> dict[str, list[int]]:
    """Add every prompt, step the engine to the end, return greedy tokens per request id.

    ``on_step(step_index, outputs)`` runs after each engine step (it may abort requests).
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    for req_id, ids in prompts.items():
        n = max_tokens if isinstance(max_tokens, int) else max_tokens[req_id]
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(req_id, {"prompt_token_ids": list(ids)}, params)
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        if on_step is not None:
            on_step(step, outputs)
        step += 1
    return tokens
