"""Admission without thrash: the most blocks a request can hold, and whether a new one fits.

Engine-free arithmetic in blocks; the connector's scheduler
(:meth:`connectors.vllm.scheduler.Scheduler.admits`) feeds it each request's shape and hole.

A request of ``P`` prompt tokens and at most ``M`` generated ones, block size ``bs``, at most
``a`` tokens scheduled beyond those it has processed (1 under async scheduling, plus any
speculative tokens; 0 otherwise). Its *peak* is the most blocks it can ever hold::

    prefill   cdiv(P + a, bs)                         the whole prompt, before its hole is back
                                                      (0 once the prompt is computed)
    growth    cdiv(P + M, bs) - hole                   up to max_tokens, minus the prompt's hole
    bounded   max(B + K, S) + 1 + cdiv(a, bs)          with a decode budget of B blocks

    peak = max(prefill, growth)                         without a decode budget
    peak = max(prefill, min(growth, bounded))           with one

With a decode budget the hole grows during generation until at most ``B`` full blocks stay
outside it (:meth:`lmcompact.compaction.hole_planner.HolePlanner.grow_for_decode`), or all of
them when the blocks before the hole (``S``: a prefill pack's kept blocks) already exceed
``B``; on top of those sit the block being filled and, with tokens in flight, the one after::

    logical blocks  [ S kept | hole ............... | <= max(B, S) - S full | filling | (next) ]

With ``protect_prompt`` the budget counts generated blocks only: the ``K`` kept prompt blocks
(``K = S`` after a pack, the prompt's full blocks without one) are held besides ``B``
(``K = 0`` otherwise).

Admission (``free`` blocks in the pool, running requests ``r`` holding ``held(r)`` blocks of
their own): a new request is admitted only when::

    free - peak(new) >= sum over running r of max(0, peak(r) - held(r))

so every running request can still reach its peak at the same time (``held(r)`` above its
peak, a prompt whose hole is not back yet, reserves nothing): none is ever preempted
for lack of blocks because another was admitted on blocks that compaction gave back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["RequestShape", "admits", "pending_blocks"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RequestShape:
    """What bounds one request's blocks.

    Attributes:
        prompt_tokens: P.
        max_tokens: M, None when the request has no limit (its peak is then the prompt's).
        block_size: tokens per block.
        hole_blocks: blocks of the prompt's hole that go back to the pool (planned or
            estimated for a fresh prompt; 0 without one).
        kept_blocks: blocks before the hole (S), which a decode budget cannot drop.
        protected_blocks: leading blocks the decode budget does not count (the kept prompt
            with ``protect_prompt``; 0 otherwise): the request holds them besides B.
        decode_budget_blocks: B, full blocks the request may hold outside its hole during
            generation; None when its generation is not bounded.
        lookahead_tokens: tokens scheduled beyond the processed ones (async scheduling,
            speculative tokens), >= 0.
        prompt_computed: the prompt is computed (scheduled in full): from then on the
            request never holds its whole prompt again (the next step gives its hole back
            before it allocates), so only the generation bounds it.
    """

    prompt_tokens: int
    max_tokens: int | None
    block_size: int
    hole_blocks: int = 0
    kept_blocks: int = 0
    decode_budget_blocks: int | None = None
    protected_blocks: int = 0
    lookahead_tokens: int = 0
    prompt_computed: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.prompt_tokens < 0 or self.lookahead_tokens < 0:
            raise ValueError(
                f"block_size must be >= 1 and token counts >= 0, got {self.block_size}, "
                f"{self.prompt_tokens}, {self.lookahead_tokens}"
            )
        if self.hole_blocks < 0 or self.kept_blocks < 0 or self.protected_blocks < 0:
            raise ValueError(
                f"hole {self.hole_blocks}, kept {self.kept_blocks} and protected "
                f"{self.protected_blocks} blocks must be >= 0"
            )
        if self.decode_budget_blocks is not None and self.decode_budget_blocks < 1:
            raise ValueError(f"decode_budget_blocks must be >= 1, got {self.decode_budget_blocks}")

    @property
    def prefill_blocks(self) -> int:
        """Blocks held while the prompt is computed (its hole comes back after); 0 once it is."""
        if self.prompt_computed:
            return 0
        return _cdiv(self.prompt_tokens + self.lookahead_tokens, self.block_size)

    @property
    def growth_blocks(self) -> int | None:
        """Blocks held at ``max_tokens`` without a decode budget (None: no limit)."""
        if self.max_tokens is None:
            return None
        return _cdiv(self.prompt_tokens + self.max_tokens, self.block_size) - self.hole_blocks

    @property
    def bounded_blocks(self) -> int | None:
        """Most blocks held during a generation bounded by the decode budget (None: none)."""
        if self.decode_budget_blocks is None:
            return None
        tail = 1 + _cdiv(self.lookahead_tokens, self.block_size)
        return max(self.decode_budget_blocks + self.protected_blocks, self.kept_blocks) + tail

    @property
    def peak_blocks(self) -> int:
        """The most blocks this request can hold from now on (see the module doc)."""
        growth, bounded = self.growth_blocks, self.bounded_blocks
        if growth is None:
            decode = bounded if bounded is not None else 0
        else:
            decode = growth if bounded is None else min(growth, bounded)
        return max(self.prefill_blocks, decode)


def pending_blocks(peak: int, held: int) -> int:
    """Blocks a running request may still take from the pool: its peak minus what it holds."""
    return max(0, peak - held)


def admits(free_blocks: int, need: int, pending: Iterable[int]) -> bool:
    """Whether a request whose peak is ``need`` fits beside the running requests' ``pending``."""
    return free_blocks - need >= sum(pending)
