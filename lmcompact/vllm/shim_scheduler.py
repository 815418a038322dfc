"""Scheduler-side vLLM facts: scheduled requests, block ids, the KV cache manager.

Part of the vLLM shim (:mod:`lmcompact.vllm.vllm_shim` re-exports these names).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled this step, as the connector needs it.

    Attributes:
        req_id: request id.
        num_computed: tokens computed before this step (including loaded ones).
        num_scheduled: tokens computed in this step.
        new_block_ids: blocks appended (or, when ``replace``, the whole row).
        replace: True when ``new_block_ids`` replaces the row (new or resumed request).
        prompt_token_ids: the prompt, for new requests (None for running ones).
    """

    req_id: str
    num_computed: int
    num_scheduled: int
    new_block_ids: list[int]
    replace: bool
    prompt_token_ids: list[int] | None


def _group0(block_ids: Any) -> list[int]:
    if block_ids is None:
        return []
    if isinstance(block_ids, tuple):
        return list(block_ids[0]) if block_ids else []
    return list(block_ids)


def scheduled_requests(scheduler_output: Any) -> Iterator[ScheduledRequest]:
    """New and running requests of a ``SchedulerOutput``."""
    counts = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        yield ScheduledRequest(
            req_id=new.req_id,
            num_computed=int(new.num_computed_tokens),
            num_scheduled=int(counts.get(new.req_id, 0)),
            new_block_ids=_group0(new.block_ids),
            replace=True,
            prompt_token_ids=list(new.prompt_token_ids or []),
        )
    cached = scheduler_output.scheduled_cached_reqs
    resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
    for i, req_id in enumerate(cached.req_ids):
        yield ScheduledRequest(
            req_id=req_id,
            num_computed=int(cached.num_computed_tokens[i]),
            num_scheduled=int(counts.get(req_id, 0)),
            new_block_ids=_group0(cached.new_block_ids[i]),
            replace=req_id in resumed,
            prompt_token_ids=None,
        )


def finished_req_ids(scheduler_output: Any) -> set[str]:
    return set(getattr(scheduler_output, "finished_req_ids", ()) or ())


def preempted_req_ids(scheduler_output: Any) -> set[str]:
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def request_prompt_ids(request: Any) -> list[int]:
    return list(request.prompt_token_ids or [])


def allocated_block_ids(blocks: Any) -> list[int]:
    """Group-0 block ids of a ``KVCacheBlocks``."""
    return _group0(blocks.get_block_ids())


_MANAGERS: list[weakref.ref[Any]] = []
"""The ``KVCacheManager`` objects created since :func:`track_kv_cache_managers` (weakly)."""


def track_kv_cache_managers(manager_class: Any = None) -> bool:
    """Record every ``KVCacheManager`` vLLM creates from now on (idempotent, class level).

    vLLM 0.32 hands connectors the manager (``bind_kv_cache_manager``); vLLM 0.26 creates the
    scheduler's connector before its manager and later hands over only
    ``manager.block_pool`` (``bind_gpu_block_pool``, from ``Scheduler.__init__``). The
    scheduler half calls this when it is built, so the manager made right after is
    recorded and :func:`kv_cache_manager_owning` can find it by its pool. Returns False when
    this vLLM has no such class. ``manager_class`` replaces vLLM's class (tests).
    """
    if manager_class is None:
        try:
            from vllm.v1.core.kv_cache_manager import KVCacheManager as manager_class
        except ImportError:
            return False
    if getattr(manager_class, "_lmcompact_tracked", False):
        return True
    init = manager_class.__init__

    def __init__(manager: Any, *args: Any, **kwargs: Any) -> None:
        init(manager, *args, **kwargs)
        _MANAGERS[:] = [ref for ref in _MANAGERS if ref() is not None]
        _MANAGERS.append(weakref.ref(manager))

    manager_class.__init__ = __init__
    manager_class._lmcompact_tracked = True
    return True


def kv_cache_manager_owning(block_pool: Any) -> Any | None:
    """The recorded ``KVCacheManager`` whose ``block_pool`` is ``block_pool`` (the very
    object), or None (see :func:`track_kv_cache_managers`)."""
    for ref in _MANAGERS:
        manager = ref()
        if manager is not None and getattr(manager, "block_pool", None) is block_pool:
            return manager
    return None
