"""Patch point: the scheduler output, read (and one flag written) by the scheduler side.

:func:`scheduled_requests` turns vLLM's new / cached request data into one
:class:`ScheduledRequest` per scheduled request (field names differ across versions);
:func:`force_sync_loads` is the one write, with the reason in its docstring.
"""

from __future__ import annotations

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


def force_sync_loads(scheduler_output: Any) -> None:
    """Make the worker run ``start_load_kv`` before this step's forward pass.

    vLLM 0.32 starts connector loads after the forward pass unless the step's output says
    it has synchronous loads (``has_sync_kv_loads``, set by vLLM's scheduler for connectors
    that report them). The connector's holes, captures and loads must be in place before
    attention runs, and the base API has no call for it, so the flag is set here (a no-op on
    engines without the field: vLLM 0.26 runs ``start_load_kv`` before the model).
    """
    if hasattr(scheduler_output, "has_sync_kv_loads"):
        scheduler_output.has_sync_kv_loads = True
