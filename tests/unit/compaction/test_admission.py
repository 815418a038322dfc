"""The admission rule's arithmetic, checked against the hole planner it predicts.

A request's peak (:class:`lmcompact.compaction.admission.RequestShape`) must be the largest
number of blocks the request ever holds when the real :class:`HolePlanner` opens and grows
its hole step by step, as the connector's scheduler drives it: not less (a running request
would be preempted) and not more (the pool would carry fewer requests than it can).
"""

from __future__ import annotations

import pytest

from lmcompact.compaction.admission import RequestShape, admits, pending_blocks
from lmcompact.compaction.hole_planner import HolePlanner, PrefillMode

BS = 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def held_over_time(
    planner: HolePlanner, prompt: int, max_tokens: int, lookahead: int = 0
) -> list[int]:
    """Blocks one request holds after each step's allocation (prefill in one step), with
    the scheduler's order per step: grow the hole, release what is visible, allocate."""
    rid = "r"
    held: list[int] = []
    # step 0: the prompt is computed; the hole (if any) is planned, visible from step 1
    planner.prefill_end(rid, prompt, first_block=0, step=0)
    held.append(cdiv(prompt + lookahead, BS))
    for i in range(1, max_tokens):  # decode step i computes token prompt + i - 1
        processed = prompt + i - 1
        planner.grow_for_decode(rid, 0, prompt, processed, step=i)
        row = cdiv(processed + 1 + lookahead, BS)
        hole = planner.visible(rid, i)
        held.append(row - (0 if hole is None else min(hole.stop, row) - hole.start))
    return held


def shape_for(
    planner: HolePlanner, prompt: int, max_tokens: int, lookahead: int = 0
) -> RequestShape:
    kept, hole = planner.fresh_hole(prompt)
    return RequestShape(
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        block_size=BS,
        hole_blocks=hole,
        kept_blocks=kept,
        decode_budget_blocks=planner.decode_budget_blocks,
        protected_blocks=planner.protected_blocks(prompt, kept if hole else None),
        lookahead_tokens=lookahead,
    )


CASES = [
    # (prefill mode, prefill budget, decode budget blocks, h2o recent blocks, prompt, max_tokens)
    (PrefillMode.PACK, 0.25, 16, None, 1024, 2048),  # kept 8 < budget 16
    (PrefillMode.PACK, 0.25, 4, None, 1024, 600),  # kept 8 > budget 4: kept + 1
    (PrefillMode.PACK, 0.25, 16, None, 1024, 100),  # ends before the budget binds
    (PrefillMode.PACK, 0.5, 8, 4, 700, 900),  # h2o decode after a pack
    (PrefillMode.OFF, 1.0, 8, None, 300, 1000),  # hole opens at the sinks during decode
    (PrefillMode.OFF, 1.0, 8, 3, 300, 1000),  # h2o: hole opens after the kept region
    (PrefillMode.OFF, 1.0, 6, None, 900, 400),  # long prompt, small budget: prefill peak
    (PrefillMode.BLOCKS, 0.5, 10, None, 640, 1500),  # StreamingLLM blocks
    (PrefillMode.PACK, 0.25, None, None, 1024, 700),  # no decode budget: growth
    (PrefillMode.OFF, 1.0, 8, None, 100, 1000),  # short prompt: the budget is the peak
    (PrefillMode.PACK, 0.5, 12, None, 320, 1200),  # kept 5, budget 12 above the prompt
    (PrefillMode.PACK, 0.5, 12, 6, 330, 1200),  # the same with h2o decode
]


@pytest.mark.parametrize("lookahead", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4]}")
def test_peak_is_the_most_blocks_the_planner_ever_leaves_held(case: tuple, lookahead: int) -> None:
    mode, budget, decode_blocks, recent, prompt, max_tokens = case
    planner = HolePlanner(
        BS, mode, budget, decode_budget_blocks=decode_blocks, decode_recent_blocks=recent
    )
    shape = shape_for(planner, prompt, max_tokens, lookahead)
    held = held_over_time(planner, prompt, max_tokens, lookahead)
    assert max(held) <= shape.peak_blocks
    if lookahead == 0:  # the generation reaches the peak (with one more in flight it may not)
        # the growth term counts cdiv(P + M): one token more than is ever computed
        slack = cdiv(prompt + max_tokens, BS) - cdiv(prompt + max_tokens - 1, BS)
        assert shape.peak_blocks - max(held) <= slack


PROTECTED_CASES = [
    # (prefill mode, prefill budget, decode budget blocks, h2o recent blocks, prompt, max_tokens)
    (PrefillMode.OFF, 1.0, 8, None, 1000, 1000),  # whole prompt (31 blocks) + 8
    (PrefillMode.OFF, 1.0, 8, 3, 1000, 1000),  # merging decode after the whole prompt
    (PrefillMode.OFF, 1.0, 8, None, 20, 1000),  # prompt under one block: the sink stays
    (PrefillMode.PACK, 0.25, 8, None, 1024, 700),  # packed to 8, then 8 generated
    (PrefillMode.PACK, 0.5, 4, None, 330, 1200),  # kept 5 blocks + 4
    (PrefillMode.PACK, 0.25, 16, None, 1024, 100),  # ends before the budget binds
]


@pytest.mark.parametrize("lookahead", [0, 1])
@pytest.mark.parametrize(
    "case", PROTECTED_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4]}"
)
def test_protected_prompt_peak_is_the_kept_prompt_plus_the_budget(
    case: tuple, lookahead: int
) -> None:
    """With ``protect_prompt`` the peak is what the planner leaves held (the kept prompt, the
    budget's generated blocks and the one filling), and nothing of the prompt is dropped."""
    mode, budget, decode_blocks, recent, prompt, max_tokens = case
    planner = HolePlanner(
        BS,
        mode,
        budget,
        decode_budget_blocks=decode_blocks,
        decode_recent_blocks=recent,
        protect_prompt=True,
    )
    shape = shape_for(planner, prompt, max_tokens, lookahead)
    held = held_over_time(planner, prompt, max_tokens, lookahead)
    assert max(held) <= shape.peak_blocks
    if lookahead == 0:
        slack = cdiv(prompt + max_tokens, BS) - cdiv(prompt + max_tokens - 1, BS)
        assert shape.peak_blocks - max(held) <= slack
    hole = planner.holes.get("r")
    if mode is PrefillMode.OFF:
        assert shape.protected_blocks == max(1, prompt // BS)
        assert hole is None or hole.start >= shape.protected_blocks  # the whole prompt stays
    else:
        assert shape.protected_blocks == shape.kept_blocks  # the pack's kept blocks
    if max_tokens > (decode_blocks + 2) * BS:  # the budget binds: kept prompt + B + filling
        assert max(held[1:]) == shape.bounded_blocks
        assert shape.bounded_blocks == shape.protected_blocks + decode_blocks + 1 + lookahead


def test_decode_budget_bounds_the_peak_below_growth() -> None:
    """The issue's workload: 1k prompt packed to 8 blocks, 2k output, budget 512 tokens."""
    bounded = RequestShape(1024, 2048, BS, hole_blocks=24, kept_blocks=8, decode_budget_blocks=16)
    unbounded = RequestShape(1024, 2048, BS, hole_blocks=24, kept_blocks=8)
    assert unbounded.peak_blocks == 96 - 24
    assert bounded.peak_blocks == max(32, 16 + 1) == 32  # the prompt itself is the peak
    assert bounded.bounded_blocks == 17
    # a pool of 384 blocks carries 384 // 17 requests once their prompts are packed
    assert 384 // bounded.bounded_blocks == 22


def test_kept_blocks_beyond_the_budget_stay_held() -> None:
    shape = RequestShape(2048, 4096, BS, hole_blocks=32, kept_blocks=32, decode_budget_blocks=8)
    assert shape.peak_blocks == max(64, 32 + 1)
    assert shape.bounded_blocks == 33


def test_lookahead_adds_a_block_in_flight() -> None:
    base = RequestShape(100, 1000, BS, decode_budget_blocks=8)
    ahead = RequestShape(100, 1000, BS, decode_budget_blocks=8, lookahead_tokens=1)
    assert (base.peak_blocks, ahead.peak_blocks) == (9, 10)


def test_no_max_tokens_is_the_prompt_or_the_budget() -> None:
    assert RequestShape(300, None, BS).peak_blocks == 10
    assert RequestShape(300, None, BS, decode_budget_blocks=16).peak_blocks == 17


def test_admits_reserves_every_running_peak() -> None:
    running = [pending_blocks(17, 9), pending_blocks(17, 20), pending_blocks(32, 0)]
    assert running == [8, 0, 32]
    assert admits(free_blocks=72, need=32, pending=running)
    assert not admits(free_blocks=71, need=32, pending=running)


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 0},
        {"prompt_tokens": -1},
        {"hole_blocks": -1},
        {"decode_budget_blocks": 0},
        {"lookahead_tokens": -2},
    ],
)
def test_bad_shapes_are_refused(bad: dict) -> None:
    args = {"prompt_tokens": 10, "max_tokens": 10, "block_size": BS, **bad}
    with pytest.raises(ValueError):
        RequestShape(**args)


def test_a_computed_prompt_reserves_only_its_generation() -> None:
    """After its prefill a packed request (held 32 until its hole is back, then 8 + 1)
    reserves up to the decode bound, not its prompt again."""
    prefill = RequestShape(1024, 2048, BS, hole_blocks=24, kept_blocks=8, decode_budget_blocks=16)
    done = RequestShape(
        1024, 2048, BS, hole_blocks=24, kept_blocks=8, decode_budget_blocks=16, prompt_computed=True
    )
    assert (prefill.peak_blocks, done.peak_blocks) == (32, 17)
    assert pending_blocks(done.peak_blocks, held=32) == 0  # the hole is not back yet
    assert pending_blocks(done.peak_blocks, held=9) == 8
