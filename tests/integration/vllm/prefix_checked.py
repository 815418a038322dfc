"""Connectors that check, at every scheduler step, that vLLM's prefix cache never holds
compacted KV (tests only).

Loaded by module path (``PrefixCheckedConnector``; its options name the ``"release"`` group
where a test packs or releases). After
the real connector planned a step (``build_connector_meta``), with what the step's own
metadata says and vLLM's block rows, independently of the connector's
:class:`~connectors.vllm.patches.kv_cache_manager.PrefixCacheGuard` bookkeeping:

* every block a pack of this step will rewrite is held by its request alone and carries no
  prefix-cache hash;
* a request that was packed, loaded compacted from the store, or scheduled while attention
  skips a hole is *compacted* from a logical block on (the pack's first rewritten block,
  the load's start, the first token computed past a hole); at every step none of its blocks
  from there on carries a hash (a later request would read them as the full prefix);
* the guard reports no violation of its own.

It also records what vLLM's own prefix cache served each request (the block-aligned local
hit vLLM hands ``get_num_new_matched_tokens``).

A failed check raises inside the engine step, which fails the test. vLLM freeing a request
(finish, abort, preemption) ends its record: recomputed, it is exact again. Real
counterpart: the connector itself, unchanged.
"""

from __future__ import annotations

from typing import Any

from connectors.vllm.connector import LMCompactConnector, LMCompactMetadata
from connectors.vllm.patches import scheduler_output as output_patch
from connectors.vllm.scheduler import Scheduler
from connectors.vllm.spec import ConnectorSpec


class PrefixChecks:
    """The per-step checks; mixed into a connector class."""

    scheduler: Scheduler | None
    spec: ConnectorSpec

    def _init_checks(self) -> None:
        self.local_hits: dict[str, int] = {}  # request -> tokens vLLM's own cache served
        self.steps_checked = 0
        self.packs_checked = 0
        self.compacted_seen: set[str] = set()
        self._compacted_from: dict[str, int] = {}

    def _mark(self, req_id: str, block: int) -> None:
        self._compacted_from[req_id] = min(block, self._compacted_from.get(req_id, block))
        self.compacted_seen.add(req_id)

    def record_local_hit(self, request: Any, num_computed_tokens: int) -> None:
        self.local_hits[request.request_id] = num_computed_tokens

    def check_step(self, meta: LMCompactMetadata, scheduler_output: Any, kept: int) -> None:
        guard = None if self.scheduler is None else self.scheduler.guard
        if guard is None:
            raise AssertionError("prefix caching is on but no PrefixCacheGuard is bound")
        rows = guard.group.req_to_blocks
        bs = self.spec.facts.block_size
        gone = output_patch.finished_req_ids(scheduler_output) | output_patch.preempted_req_ids(
            scheduler_output
        )
        for req_id in gone:
            self._compacted_from.pop(req_id, None)
        problems: list[str] = []
        for job in meta.packs:
            first, stop = job.start // bs, (job.start + job.reserved) // bs
            for index, block in enumerate(rows[job.req_id][first:stop], first):
                if block.ref_cnt != 1 or block.block_hash is not None:
                    problems.append(
                        f"pack of {job.req_id} rewrites block {block.block_id} (index {index}) "
                        f"with ref_cnt {block.ref_cnt}, hash {block.block_hash!r}"
                    )
            self._mark(job.req_id, first)
            self.packs_checked += 1
        if kept < self.spec.config.store.chunk_size:
            for load in meta.step.loads:
                self._mark(load.req_id, load.start // bs)
        for sched in output_patch.scheduled_requests(scheduler_output):
            row = rows.get(sched.req_id, [])
            for key, hole in meta.step.holes.items():
                column = hole.key_column
                if column < len(row) and not row[column].is_null and row[column].block_id == key:
                    self._mark(sched.req_id, sched.num_computed // bs)
        for req_id, first in self._compacted_from.items():
            row = rows.get(req_id, [])
            for index in range(first, len(row)):
                block = row[index]
                if not block.is_null and block.block_hash is not None:
                    problems.append(
                        f"{req_id}: block {block.block_id} (index {index}, compacted from "
                        f"{first}) is hashed {block.block_hash!r}"
                    )
        violations = guard.violations()
        if violations:
            problems.append(f"guard violations {violations}")
        if problems:
            shown = "; ".join(problems[:4]) + (
                f"; ... ({len(problems)} in all)" * (len(problems) > 4)
            )
            raise AssertionError(f"compacted KV in vLLM's prefix cache: {shown}")
        self.steps_checked += 1


class _CheckedSteps(PrefixChecks):
    """Records vLLM's own hits and checks every step's metadata; mixed in before a
    connector class (its ``super()`` calls reach the connector)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_checks()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.record_local_hit(request, num_computed_tokens)
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(  # type: ignore[misc]
            request, num_computed_tokens
        )
        return result

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        self.check_step(meta, scheduler_output, self._scheduler().slots)  # type: ignore[attr-defined]
        return meta


class PrefixCheckedConnector(_CheckedSteps, LMCompactConnector):
    pass
