"""Which tensor-parallel ranks still owe the report of a request's in-place pack.

The scheduler half plans a pack in step ``t``; every rank packs its own KV heads in its
``wait_for_save`` of step ``t`` and reports ``(request id, rank)``
(:attr:`lmcompact.vllm.metadata.WorkerReport.packed`); vLLM merges the ranks' reports of a step.
The pack's hole blocks go back to the pool only once every rank's report arrived, so no
rank's forward pass can write a block that rank has not packed from. With one rank nothing
is tracked: the worker's own step order already puts its pack before any later write.
"""

from __future__ import annotations

from collections.abc import Iterable

from lmcompact.vllm.request_state import RequestStates


class RankPacks:
    """Pending pack reports, kept in each request's record
    (:attr:`lmcompact.vllm.request_state.RequestState.packs_owed`; they go with it).

    Args:
        tp_size: tensor-parallel ranks (>= 1).
        states: the scheduler side's records.
    """

    def __init__(self, tp_size: int, states: RequestStates) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self.states = states

    def expect(self, req_id: str) -> None:
        """A pack of ``req_id`` was planned (again, after a preemption: all ranks owe it)."""
        state = self.states.get(req_id)
        if self.tp_size > 1 and state is not None:
            state.packs_owed = set(range(self.tp_size))

    def confirm(self, packed: Iterable[tuple[str, int]]) -> None:
        """Fold one step's merged reports in: ``(request id, rank)`` per pack done."""
        for req_id, rank in packed:
            state = self.states.get(req_id)
            if state is not None:
                state.packs_owed.discard(rank)

    def pending(self, req_id: str) -> bool:
        """Whether some rank has not reported the last planned pack of ``req_id``."""
        state = self.states.get(req_id)
        return state is not None and bool(state.packs_owed)
