"""Admission without thrash for the release group (``reserve_growth``), a part of
:class:`lmcompact.vllm.memory.scheduler_side.MemoryScheduler`.

vLLM admits a waiting request when its
next chunk fits in the free blocks; blocks freed by holes make room for more requests than
the pool can carry once their generations grow, and vLLM then preempts (and recomputes,
and re-packs) running requests. The wrapped ``allocate_slots`` therefore refuses a request
that holds no block yet (an admission; vLLM keeps it waiting) unless::

    free_blocks - need(new) >= sum over running r of pending(r)

    need(new)  = max(cdiv(P, bs), cdiv(P + M, bs) - hole(P))    its peak holding
    pending(r) = max(prompt blocks r still has to allocate,
                     cdiv(P + M, bs) - len(row(r)) - hole still to come back)

with P the prompt, M ``max_tokens`` and ``hole(P)`` the blocks a prompt of P tokens gives
back at prefill end (0 when it is not compacted). A request admitted under this rule always
finds its growth in the pool, so only requests that vLLM would have preempted anyway (none
here when nothing else allocates) are. When no request is running, nothing is refused.
"""

from __future__ import annotations

from typing import Any

from lmcompact.vllm.memory.scheduler_state import MemorySchedulerState


class GrowthReserve(MemorySchedulerState):
    """Refuses an admission that would eat the growth reserved for running requests."""

    def _hole_blocks(self, prompt_len: int) -> int:
        """Blocks a fresh prompt of ``prompt_len`` tokens gives back at prefill end."""
        nb = prompt_len // self.block_size
        if self.planner.prefill_mode.value == "off" or nb < self.planner.min_prompt_blocks:
            return 0
        kb = self.planner.kept_blocks(nb)
        if kb >= nb:
            return 0
        if self.planner.prefill_mode.value == "pack":
            return nb - self.planner.reserved_blocks(kb, nb)
        return nb - kb

    def _final_blocks(self, request: Any) -> int | None:
        """Logical blocks the request will have once it generated ``max_tokens``."""
        max_tokens = getattr(request, "max_tokens", None)
        if max_tokens is None:
            return None
        total = int(request.num_prompt_tokens) + int(max_tokens)
        return -(-total // self.block_size)

    def pending_blocks(self, request: Any) -> int:
        """Blocks a running request may still take from the pool (see module doc)."""
        final = self._final_blocks(request)
        row = self._ledger().blocks(request.request_id)
        if final is None:
            return 0
        prompt_len = int(request.num_prompt_tokens)
        remaining = final - len(row)
        if request.request_id in self.planner.holes:  # packed or hole planned: it came back
            return max(0, remaining)
        prompt_rest = -(-prompt_len // self.block_size) - len(row)
        return max(0, prompt_rest, remaining - self._hole_blocks(prompt_len))

    def admits(self, request: Any) -> bool:
        """Whether a request may get blocks now (always, unless it is a new admission that
        would eat the growth reserved for running requests)."""
        if not self.reserve_growth or self.ledger is None:
            return True
        ledger = self.ledger
        if ledger.blocks(request.request_id):
            return True  # already running: its growth was reserved
        running = [
            state.request
            for rid, state in self.states.items()
            if state.request is not None and rid != request.request_id
        ]
        if not running:
            return True
        final = self._final_blocks(request)
        prompt_len = int(request.num_prompt_tokens)
        full = -(-prompt_len // self.block_size)
        need = full if final is None else max(full, final - self._hole_blocks(prompt_len))
        reserve = sum(self.pending_blocks(r) for r in running)
        if ledger.num_free() - need >= reserve:
            return True
        self.stats.admissions_deferred += 1
        return False
