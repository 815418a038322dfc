"""Where each request's hole lies, step by step (engine-free bookkeeping, in blocks).

Every request has at most one hole: a run of logical blocks that attention skips and whose
physical blocks go back to the pool (a :class:`~lmcompact.compaction.holes.HoleState`; in
the connector it lives in the request's one
:class:`~connectors.vllm.requests.RequestState`, and the planner reads and writes it
through ``holes``). A compacted store load opens one (the store half, ``owned=False``: only
released, never grown); the planner opens or grows the others:

Prefill end (the step whose forward pass computes the prompt's last token), over the
prompt's full blocks ``nb = prompt_len // bs``, keeping ``kb`` of them:

``pack`` (any policy; the worker copies kept tokens after that step's forward)::

    logical blocks  [ 0 .. kb-1 | kb ........ nb-1 | nb (partial) .. ]
    contents        [ kept, packed | hole          | tail, untouched  ]

With vLLM's prefix caching, the first ``p`` blocks may be *protected* (shared with another
request, or hits from vLLM's cache that other requests may hit again): a pack never
rewrites them, so it compacts the span after them and sliding-window layers skip them::

    logical blocks  [ 0 .. p-1 | p .. p+kb-1 | p+kb ...... nb-1 | nb (partial) .. ]
    contents        [ protected| kept, packed | hole            | tail, untouched  ]

``blocks`` (StreamingLLM at block granularity: sinks + most recent blocks, no copy)::

    logical blocks  [ 0 .. s-1 | s ....... nb-r-1 | nb-r .. nb-1 | nb .. ]
    contents        [ sinks    | hole             | recent       | tail ]

Decode (a token budget for long generation, StreamingLLM style): once the prompt is
processed, whenever the request holds more than ``budget_blocks`` full blocks outside the
hole, the oldest block after the hole joins it::

    [ kept | hole ........ | b | ... newest full | partial ]   ->   [ kept | hole ... b | ...]

So a request holds at most ``budget_blocks`` full blocks plus the one being filled.

With ``protect_prompt`` the budget counts generated blocks only: the prompt's kept full blocks
(all of them without a prefill pack, those before the pack's hole with one) are never dropped
or merged, a hole opened during generation starts after them, and a request holds at most
those plus ``budget_blocks`` plus the one being filled::

    [ prompt (whole) | hole ........ | newest generated ... | partial ]

With ``decode_recent_blocks`` r (H2O decode), a hole opened during generation starts after
``budget_blocks - r`` blocks instead of the sinks, and every block about to join the hole is
first merged into the kept region before it (the scheduler sends a
:class:`lmcompact.compaction.heavy_hitters.MergeJob`; the worker keeps each head's highest
scored tokens there)::

    [ sinks | kept region (heavy hitters) | hole ....... | b | recent ... | partial ]
      b is merged into the kept region, then joins the hole

Per-head counts (``per_head_slack`` s, ``per_head_layer_slack`` r): the policy's counts differ
per (layer, head), each at most ``ceil(kb * s)`` blocks' worth, but one block row serves
every head, so a layer's heads share ``kr = min(ceil(kb * r), nb - 1)`` reserved blocks as
dense cells, head after head (:mod:`lmcompact.compaction.per_head`), and the hole starts
after them; the per-head recompute attends to them
(:mod:`lmcompact.compaction.per_head_attention`).

Sliding-window layers (``HoleState.window_lead``, see :mod:`lmcompact.compaction.holes`): after a
``pack`` their kept tokens are the span's most recent ones, so the kept blocks sit at their
logical distance and they skip nothing more (lead 0). The sinks of ``blocks`` mode, and the
kept region once a hole grew during decode, would sit closer than they are: sliding layers
skip everything before the hole (lead = start). Merging decode policies keep sliding layers'
most recent candidates at every merge, so there they skip only the fixed blocks (sinks, or a
protected prompt): the rest of the kept region runs on into the tail (lead = fixed).

Two-stage loads (:meth:`HolePlanner.repack`): a request that loaded compacted chunks holds
their kept rows in blocks ``[0, S)`` and a hole ``[S, S + L)`` before its own tail. At its
prefill end the kept rows and the tail's full blocks (the blocks outside the hole) are packed
again to the final budget ``kb`` of the whole prompt, and the hole becomes ``[kb, nb)``::

    before   [ stored kept (S) | load's hole (L) | tail full blocks | partial ]
    after    [ kept (kb) | hole ..................................... | partial ]

A hole opened at prefill end becomes visible (skipped by attention, released to the pool)
only from the next step: that step's forward pass still attends to the whole prompt, and a
pack reads hole blocks after it. The first block is never in a hole: the worker finds a
request's batch row by it.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from enum import StrEnum

from lmcompact.compaction.holes import HoleState

__all__ = ["HolePlanner", "HoleState", "Pack", "PrefillMode"]


class PrefillMode(StrEnum):
    """How the prompt is compacted when its prefill ends."""

    OFF = "off"
    PACK = "pack"
    BLOCKS = "blocks"


@dataclass(frozen=True)
class Pack:
    """Worker job: pack kept tokens of ``[start, start + num_tokens)`` into slots
    ``[start, start + kept)``.

    Attributes:
        req_id: request id.
        num_tokens: tokens compacted (whole blocks).
        kept: tokens every (layer, head) keeps (whole blocks); with per-head counts, the
            mean count the policy is asked for.
        reserved: slots every head holds (whole blocks; the hole starts there): ``kept``,
            or more with per-head counts.
        start: first token of the span (protected blocks before it stay untouched).
    """

    req_id: str
    num_tokens: int
    kept: int
    reserved: int
    start: int = 0


class HolePlanner:
    """Opens, grows and reports holes; knows nothing of vLLM objects.

    Args:
        block_size: tokens per KV block.
        prefill_mode: what happens at prefill end.
        budget: kept fraction of the prompt's full blocks at prefill end, in (0, 1].
        sink_blocks: leading blocks never dropped (``blocks`` mode and decode), >= 1.
        decode_budget_blocks: full blocks a request may hold outside its hole once its
            prompt is processed; None leaves generation unbounded.
        min_prompt_blocks: prompts with fewer full blocks are not compacted at prefill end.
        per_head_slack: ``pack`` mode with per-head counts: one head keeps at most
            ``ceil(kept_blocks * slack)`` blocks' worth of tokens; None: every head keeps
            ``kept_blocks``.
        per_head_layer_slack: with per-head counts, blocks reserved for a layer's dense
            cells are ``ceil(kept_blocks * layer_slack)`` (at most all but one), in
            ``[1, per_head_slack]``.
        decode_recent_blocks: H2O decode: recent blocks kept after a hole that opens during
            generation (the kept region is ``decode_budget_blocks`` minus these); None:
            StreamingLLM decode (the hole opens after the sinks).
        holes: where the holes live, per request id (the connector's scheduler passes its
            :attr:`connectors.vllm.requests.RequestStates.holes`); a dict of its own
            when None.
        protect_prompt: the decode budget counts generated blocks only; the prompt's kept
            full blocks stay (needs a decode budget; not with ``blocks`` prefill, nor with
            a merging decode after a ``pack``: its kept region would be the prompt's).
    """

    def __init__(
        self,
        block_size: int,
        prefill_mode: PrefillMode,
        budget: float,
        sink_blocks: int = 1,
        decode_budget_blocks: int | None = None,
        min_prompt_blocks: int = 2,
        per_head_slack: float | None = None,
        decode_recent_blocks: int | None = None,
        holes: MutableMapping[str, HoleState] | None = None,
        per_head_layer_slack: float = 1.0,
        protect_prompt: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget must be in (0, 1], got {budget}")
        if sink_blocks < 1:
            raise ValueError(
                f"sink_blocks must be >= 1 (block 0 keys the batch row), got {sink_blocks}"
            )
        if decode_budget_blocks is not None and decode_budget_blocks <= sink_blocks:
            raise ValueError(
                f"decode_budget_blocks must exceed sink_blocks={sink_blocks}, got "
                f"{decode_budget_blocks}"
            )
        self.block_size = block_size
        self.prefill_mode = prefill_mode
        self.budget = budget
        self.sink_blocks = sink_blocks
        if per_head_slack is not None and not 1.0 <= per_head_layer_slack <= per_head_slack:
            raise ValueError(
                f"need 1 <= per_head_layer_slack <= per_head_slack, got {per_head_layer_slack}"
                f" and {per_head_slack}"
            )
        if decode_recent_blocks is not None and (
            decode_budget_blocks is None
            or not 0 <= decode_recent_blocks < decode_budget_blocks - sink_blocks
        ):
            raise ValueError(
                f"decode_recent_blocks must leave more than sink_blocks={sink_blocks} of "
                f"decode_budget_blocks={decode_budget_blocks}, got {decode_recent_blocks}"
            )
        if protect_prompt and (
            decode_budget_blocks is None
            or prefill_mode is PrefillMode.BLOCKS
            or (prefill_mode is PrefillMode.PACK and decode_recent_blocks is not None)
        ):
            raise ValueError(
                "protect_prompt needs a decode budget, and prefill 'off' (or 'pack' with "
                "the 'recent' decode policy): a 'blocks' prefill keeps prompt blocks after "
                "its hole, and after a 'pack' a merging decode would merge into the prompt"
            )
        self.decode_budget_blocks = decode_budget_blocks
        self.decode_recent_blocks = decode_recent_blocks
        self.protect_prompt = protect_prompt
        self.per_head_slack = per_head_slack
        self.per_head_layer_slack = per_head_layer_slack
        self.min_prompt_blocks = max(2, min_prompt_blocks)
        self.holes: MutableMapping[str, HoleState] = {} if holes is None else holes

    # ------------------------------------------------------------------ prefill end
    def kept_blocks(self, prompt_blocks: int) -> int:
        """Blocks kept of ``prompt_blocks`` at prefill end (>= sink_blocks, <= all)."""
        kept = max(self.sink_blocks, round(self.budget * prompt_blocks))
        return min(prompt_blocks, kept)

    def reserved_blocks(self, kept_blocks: int, prompt_blocks: int) -> int:
        """Blocks the kept tokens hold after a pack: ``kept_blocks``, or with per-head
        counts ``ceil(kept_blocks * layer_slack)`` (a layer's dense cells), leaving at least
        one block of hole."""
        if self.per_head_slack is None:
            return kept_blocks
        wanted = math.ceil(kept_blocks * self.per_head_layer_slack - 1e-9)
        return max(kept_blocks, min(wanted, prompt_blocks - 1))

    def head_cap(self, kept_tokens: int, num_tokens: int) -> int | None:
        """Most tokens one (layer, head) keeps in a per-head pack of ``kept_tokens`` mean
        count: ``ceil(kept * slack)``, below ``num_tokens``; None without per-head counts."""
        if self.per_head_slack is None:
            return None
        return max(
            kept_tokens, min(math.ceil(kept_tokens * self.per_head_slack - 1e-9), num_tokens - 1)
        )

    def prefill_end(
        self, req_id: str, prompt_len: int, first_block: int, step: int, protected: int = 0
    ) -> Pack | None:
        """Open the request's hole for the step that completes its prompt.

        Args:
            protected: leading blocks a pack must not rewrite (``pack`` mode compacts the
                span after them; the budget applies to that span; with per-head counts
                such a prompt is not packed). ``blocks`` mode rewrites nothing and ignores
                it.

        Returns:
            The pack the worker must run after this step's forward pass (``pack`` mode),
            else None.
        """
        if self.prefill_mode is PrefillMode.OFF or req_id in self.holes:
            return None
        bs = self.block_size
        nb = prompt_len // bs
        if self.prefill_mode is PrefillMode.PACK:
            span = nb - protected
            kb = self.kept_blocks(span) if span > 0 else 0
            if nb < self.min_prompt_blocks or kb >= span:
                return None
            if protected and self.per_head_slack is not None:
                return None
            kr = self.reserved_blocks(kb, span)
            self.holes[req_id] = HoleState(
                first_block,
                protected + kr,
                span - kr,
                visible_from=step + 1,
                window_lead=protected,
            )
            return Pack(req_id, span * bs, kb * bs, kr * bs, protected * bs)
        kb = self.kept_blocks(nb)
        if nb < self.min_prompt_blocks or kb >= nb:
            return None
        sinks = min(self.sink_blocks, kb)
        recent = kb - sinks
        self.holes[req_id] = HoleState(
            first_block, sinks, nb - recent - sinks, visible_from=step + 1, window_lead=sinks
        )
        return None

    def repack(self, req_id: str, prompt_len: int, step: int) -> tuple[Pack, HoleState] | None:
        """Two-stage loads: pack a request that loaded compacted chunks to the final budget
        at its prefill end (see the module doc).

        The request's current hole (the load's, not owned) is replaced by ``[kb, nb)``,
        visible from the next step; the caller keeps skipping the load's hole in this step.

        Returns:
            The pack over the blocks outside the load's hole (``Pack.num_tokens`` counts
            those only) and the load's hole it replaces, or None when nothing is packed (no
            load hole, a prompt too short, or a budget that leaves the kept rows whole).
        """
        old = self.holes.get(req_id)
        if self.prefill_mode is not PrefillMode.PACK or old is None or old.owned:
            return None
        bs = self.block_size
        nb = prompt_len // bs
        visible = nb - old.length
        kb = self.kept_blocks(nb)
        if nb < self.min_prompt_blocks or old.stop > nb or kb >= old.start or kb >= visible:
            # the kept blocks must lie before the load's hole (they are rewritten in place)
            return None
        self.holes[req_id] = HoleState(
            old.first_block, kb, nb - kb, visible_from=step + 1, window_lead=0
        )
        return Pack(req_id, visible * bs, kb * bs, kb * bs, 0), old

    def fresh_hole(self, prompt_len: int) -> tuple[int, int]:
        """``(start, length)`` in blocks of the hole a fresh prompt of ``prompt_len`` tokens
        gets at its prefill end, without protected blocks; ``(0, 0)`` when it gets none."""
        nb = prompt_len // self.block_size
        if self.prefill_mode is PrefillMode.OFF or nb < self.min_prompt_blocks:
            return 0, 0
        kb = self.kept_blocks(nb)
        if kb >= nb:
            return 0, 0
        if self.prefill_mode is PrefillMode.PACK:
            kr = self.reserved_blocks(kb, nb)
            return kr, nb - kr
        sinks = min(self.sink_blocks, kb)
        return sinks, nb - kb

    # ------------------------------------------------------------------ decode
    def grow_for_decode(
        self,
        req_id: str,
        first_block: int,
        prompt_len: int,
        processed_tokens: int,
        step: int,
        merged: bool = True,
    ) -> bool:
        """Grow the hole so that at most ``decode_budget_blocks`` full blocks stay outside it.

        Only blocks whose tokens are all processed (``< processed_tokens``) join the hole, and
        only once the prompt is processed and any pending pack has run. With H2O decode the
        caller must merge the blocks that joined (``[old stop, new stop)``) into the kept
        region ``[0, hole.start)`` before anything reads or reuses them; ``merged`` False
        says it will not (prefix caching shares the request's blocks), and from then on
        sliding-window layers skip the whole kept region.

        Returns:
            True when the hole changed.
        """
        budget = self.decode_budget_blocks
        if budget is None or processed_tokens < prompt_len:
            return False
        hole = self.holes.get(req_id)
        if hole is None:
            start = max(self.sink_blocks, self.protected_blocks(prompt_len, None))
            lead = start
            if self.decode_recent_blocks is not None:  # H2O: room for a kept region
                start = self.protected_blocks(prompt_len, None) + budget - self.decode_recent_blocks
                lead = self.merge_fixed_blocks(prompt_len, start)
            hole = HoleState(first_block, start, 0, visible_from=step, window_lead=lead)
            self.holes[req_id] = hole
        if not hole.owned or hole.visible_from > step:
            return False
        full = processed_tokens // self.block_size
        outside = full - hole.length - self.protected_blocks(prompt_len, hole.start)
        if hole.stop > full or outside <= budget:
            return False
        grow = min(outside - budget, full - hole.stop)
        hole.length += grow
        if grow > 0:
            fixed = self.merge_fixed_blocks(prompt_len, hole.start)
            if self.decode_recent_blocks is not None and merged and hole.window_lead <= fixed:
                # every merge so far kept sliding layers' newest candidates: the kept
                # region after the fixed blocks and the tail are one run of positions
                hole.window_lead = fixed
            else:
                hole.window_lead = hole.start  # the kept region no longer sits at its distance
        return grow > 0

    def protected_blocks(self, prompt_len: int, hole_start: int | None) -> int:
        """Leading full blocks the decode budget neither counts nor drops: with
        ``protect_prompt`` the prompt's kept ones (those before a hole starting at
        ``hole_start``, all of them when None), else 0."""
        if not self.protect_prompt:
            return 0
        nb = prompt_len // self.block_size
        return max(self.sink_blocks, nb if hole_start is None else min(hole_start, nb))

    def merge_fixed_blocks(self, prompt_len: int, hole_start: int) -> int:
        """Leading blocks of the kept region a decode merge never replaces: the sinks, or
        with ``protect_prompt`` the prompt's kept blocks."""
        return max(self.sink_blocks, self.protected_blocks(prompt_len, hole_start))

    # ------------------------------------------------------------------ queries
    def visible(self, req_id: str, step: int) -> HoleState | None:
        """The hole attention must skip in ``step`` (None: none, empty or not yet)."""
        hole = self.holes.get(req_id)
        if hole is None or hole.length == 0 or hole.visible_from > step:
            return None
        return hole
