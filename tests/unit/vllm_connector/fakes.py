"""Stand-ins for what the connector reads of vLLM, and the connector's halves built from options.

The halves are built as the connector builds them (:meth:`ConnectorSpec.from_parts`, which
runs the start-up checks), over :class:`EngineFacts` given here instead of read from an
engine. :class:`Manager` is vLLM's ``KVCacheManager`` as the scheduler side sees it: a real
``BlockPool``, one KV-cache group's block rows, ``allocate_slots`` / ``free``, and the
coordinator methods the prefix-cache guard wraps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.patches.engine import EngineFacts
from connectors.vllm.scheduler import Scheduler
from connectors.vllm.spec import ConnectorSpec
from lmcompact.store import StoreConfig, TieredStore

FACTS: dict[str, Any] = {
    "model_id": "tiny",
    "block_size": 32,
    "num_layers": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "dtype": torch.float32,
    "prefix_caching": False,
    "device_type": "cpu",
    "tp_size": 1,
}


def facts(**overrides: Any) -> EngineFacts:
    """Engine facts of a tiny CPU engine (``overrides`` replace fields)."""
    return EngineFacts(**{**FACTS, **overrides})


def spec(extra: Mapping[str, Any], max_model_len: int = 4096, **overrides: Any) -> ConnectorSpec:
    """The spec of ``kv_connector_extra_config`` ``extra`` on :func:`facts` (checked)."""
    return ConnectorSpec.from_parts(
        ConnectorConfig.from_extra(extra), facts(**overrides), max_model_len
    )


def stores(of: ConnectorSpec) -> list[TieredStore]:
    """One CPU store per tensor-parallel rank, in that rank's namespace."""
    return [TieredStore(ns, StoreConfig(cpu_capacity_bytes=1 << 24)) for ns in of.namespaces]


def scheduler(extra: Mapping[str, Any], **overrides: Any) -> Scheduler:
    """A scheduler side for ``extra`` with fresh per-rank stores."""
    built = spec(extra, **overrides)
    return Scheduler(built, stores(built))


def request(
    req_id: str, prompt: list[int], params: Any = None, max_tokens: int | None = None
) -> SimpleNamespace:
    """vLLM's ``Request`` with the fields the scheduler side reads."""
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        num_prompt_tokens=len(prompt),
        num_computed_tokens=0,
        max_tokens=max_tokens,
        kv_transfer_params=params,
    )


def new(req: Any, block_ids: Sequence[int], num_computed: int = 0) -> SimpleNamespace:
    """``NewRequestData`` of ``req`` (a new or resumed request: its whole row)."""
    return SimpleNamespace(
        req_id=req.request_id,
        num_computed_tokens=num_computed,
        block_ids=(list(block_ids),),
        prompt_token_ids=req.prompt_token_ids,
    )


def output(
    new: Iterable[Any] = (),
    cached: Mapping[str, tuple[int, list[int]]] | None = None,
    scheduled: Mapping[str, int] | None = None,
    finished: Iterable[str] = (),
    preempted: Iterable[str] = (),
    resumed: Iterable[str] = (),
) -> SimpleNamespace:
    """A ``SchedulerOutput`` with the fields the scheduler side reads.

    Args:
        new: ``NewRequestData`` (:func:`new`).
        cached: running requests: ``req_id -> (num_computed_tokens, new block ids)``.
        scheduled: tokens scheduled per request (default 1 each).
    """
    new = list(new)
    cached = dict(cached or {})
    counts = {r.req_id: 1 for r in new} | dict.fromkeys(cached, 1) | dict(scheduled or {})
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached),
            num_computed_tokens=[c for c, _ in cached.values()],
            new_block_ids=[(ids,) for _, ids in cached.values()],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=counts,
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        has_sync_kv_loads=False,
    )


class Manager:
    """vLLM's ``KVCacheManager`` as the connector's scheduler side uses it (one group).

    ``allocate_slots(request, n)`` grows the request's row to cover its computed tokens
    plus ``n`` (None when the pool is short, as vLLM); ``free(request)`` gives the row
    back. With ``prefix_caching`` the pool hashes, and ``coordinator.cache_blocks`` hashes
    a request's full blocks as vLLM's does (``request.block_hashes``).
    """

    def __init__(self, num_blocks: int = 64, block_size: int = 32, prefix_caching: bool = False):
        from vllm.v1.core.block_pool import BlockPool

        self.block_size = block_size
        self.block_pool = BlockPool(
            num_gpu_blocks=num_blocks, enable_caching=prefix_caching, hash_block_size=block_size
        )
        self.group = SimpleNamespace(req_to_blocks={}, block_size=block_size)
        self._cached: dict[str, int] = {}
        self.coordinator = SimpleNamespace(
            single_type_managers=(self.group,),
            cache_blocks=self._cache_blocks,
            free=self._free_id,
            pop_blocks_for_free=self._pop,
        )

    def row(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.group.req_to_blocks.get(req_id, [])]

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        row = self.group.req_to_blocks.setdefault(request.request_id, [])
        total = int(request.num_computed_tokens) + num_new_tokens
        need = -(-total // self.block_size) - len(row)
        if need > self.block_pool.get_num_free_blocks():
            return None
        if need > 0:
            row.extend(self.block_pool.get_new_blocks(need))
        return row

    def free(self, request: Any) -> None:
        self.coordinator.free(request.request_id)  # as vLLM's manager (the guard wraps it)

    def _cache_blocks(self, request: Any, num_tokens: int) -> None:
        row = self.group.req_to_blocks[request.request_id]
        done, full = self._cached.get(request.request_id, 0), num_tokens // self.block_size
        self.block_pool.cache_full_blocks(request, row, done, full, self.block_size, 0)
        self._cached[request.request_id] = max(done, full)

    def _pop(self, req_id: str) -> list[Any]:
        self._cached.pop(req_id, None)
        return self.group.req_to_blocks.pop(req_id, [])

    def _free_id(self, req_id: str) -> None:
        self.block_pool.free_blocks(reversed(self._pop(req_id)))
