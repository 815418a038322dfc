"""HolePlanner: where holes open, when they become visible, how decode grows them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcompact.compaction.hole_planner import HolePlanner, HoleState, PrefillMode

BS = 32


def test_pack_opens_hole_after_kept_blocks_visible_next_step() -> None:
    planner = HolePlanner(BS, PrefillMode.PACK, budget=0.25)
    pack = planner.prefill_end("r", prompt_len=16 * BS + 5, first_block=7, step=3)
    assert pack is not None and (pack.num_tokens, pack.kept) == (16 * BS, 4 * BS)
    assert planner.visible("r", 3) is None  # the pack step still attends to the whole prompt
    hole = planner.visible("r", 4)
    assert hole is not None and (hole.first_block, hole.start, hole.stop) == (7, 4, 16)
    assert planner.prefill_end("r", 16 * BS + 5, 7, 9) is None  # once per request


def test_protected_blocks_stay_and_the_span_after_them_is_packed() -> None:
    """Prefix caching: the first blocks are shared; the budget applies to the rest."""
    planner = HolePlanner(BS, PrefillMode.PACK, budget=0.25)
    pack = planner.prefill_end("r", 16 * BS + 5, first_block=7, step=3, protected=4)
    assert pack is not None
    assert (pack.start, pack.num_tokens, pack.kept) == (4 * BS, 12 * BS, 3 * BS)
    hole = planner.visible("r", 4)
    assert hole is not None and (hole.start, hole.stop, hole.window_lead) == (7, 16, 4)
    # nothing left to compact after the protected blocks
    assert planner.prefill_end("s", 16 * BS, 8, 0, protected=15) is None
    assert planner.prefill_end("t", 16 * BS, 9, 0, protected=16) is None
    assert "s" not in planner.holes and "t" not in planner.holes
    per_head = HolePlanner(BS, PrefillMode.PACK, budget=0.25, per_head_slack=1.5)
    assert per_head.prefill_end("r", 16 * BS, 7, 0, protected=2) is None  # packs from 0 only
    assert per_head.prefill_end("u", 16 * BS, 7, 0, protected=0) is not None


def test_uniform_pack_reserves_exactly_the_kept_blocks() -> None:
    planner = HolePlanner(BS, PrefillMode.PACK, budget=0.25)
    pack = planner.prefill_end("r", 16 * BS, first_block=7, step=0)
    assert pack is not None and pack.reserved == pack.kept == 4 * BS


@pytest.mark.parametrize(
    ("prompt_blocks", "budget", "layer_slack", "kept", "reserved"),
    [
        (16, 0.25, 1.5, 4, 6),  # ceil(4 * 1.5) = 6
        (16, 0.25, 1.3, 4, 6),  # ceil(5.2) = 6
        (16, 0.25, 1.0, 4, 4),  # dense cells at the mean: the uniform footprint
        (16, 0.75, 1.5, 12, 15),  # ceil(18) clipped: at least one block of hole
        (10, 0.5, 1.2, 5, 6),
    ],
)
def test_per_head_pack_reserves_the_layer_slack_blocks(
    prompt_blocks: int, budget: float, layer_slack: float, kept: int, reserved: int
) -> None:
    planner = HolePlanner(
        BS, PrefillMode.PACK, budget=budget, per_head_slack=2.0, per_head_layer_slack=layer_slack
    )
    pack = planner.prefill_end("r", prompt_blocks * BS + 3, first_block=2, step=0)
    assert pack is not None
    assert (pack.kept, pack.reserved) == (kept * BS, reserved * BS)
    hole = planner.visible("r", 1)
    assert hole is not None and (hole.start, hole.stop) == (reserved, prompt_blocks)
    # one head may keep up to slack x the mean, below the span
    assert planner.head_cap(kept * BS, prompt_blocks * BS) == min(
        2 * kept * BS, prompt_blocks * BS - 1
    )


def test_per_head_layer_slack_lies_between_one_and_the_head_slack() -> None:
    assert HolePlanner(BS, PrefillMode.PACK, budget=0.25).head_cap(64, 256) is None
    for bad in (0.5, 2.5):
        with pytest.raises(ValueError, match="per_head_layer_slack"):
            HolePlanner(
                BS, PrefillMode.PACK, budget=0.25, per_head_slack=2.0, per_head_layer_slack=bad
            )


def test_blocks_mode_keeps_sinks_and_recent_blocks_without_pack() -> None:
    planner = HolePlanner(BS, PrefillMode.BLOCKS, budget=0.5, sink_blocks=1)
    assert planner.prefill_end("r", 9 * BS + 12, first_block=3, step=0) is None
    hole = planner.visible("r", 1)
    # 9 full blocks, keep round(4.5) = 4: sink block 0 and recent blocks 6..8
    assert hole is not None and (hole.start, hole.length) == (1, 5)


@pytest.mark.parametrize("mode", [PrefillMode.OFF, PrefillMode.PACK, PrefillMode.BLOCKS])
def test_short_prompts_and_off_mode_open_nothing(mode: PrefillMode) -> None:
    planner = HolePlanner(BS, mode, budget=0.5)
    assert planner.prefill_end("r", BS + 31, 1, 0) is None  # one full block
    assert planner.visible("r", 5) is None


def test_full_budget_keeps_everything() -> None:
    planner = HolePlanner(BS, PrefillMode.PACK, budget=1.0)
    assert planner.prefill_end("r", 10 * BS, 1, 0) is None


def test_decode_growth_waits_for_prompt_and_pack() -> None:
    planner = HolePlanner(BS, PrefillMode.PACK, budget=0.5, decode_budget_blocks=6)
    assert not planner.grow_for_decode("r", 1, prompt_len=8 * BS, processed_tokens=5 * BS, step=0)
    assert planner.holes == {}  # still prefilling
    planner.prefill_end("r", 8 * BS, 1, step=1)  # hole [4, 8) visible from step 2
    assert not planner.grow_for_decode("r", 1, 8 * BS, 11 * BS, step=1)
    assert planner.grow_for_decode("r", 1, 8 * BS, 11 * BS, step=2)
    hole = planner.visible("r", 2)
    assert hole is not None and (hole.start, hole.length) == (4, 5)  # 11 full - 5 = 6 outside


def test_store_load_holes_are_never_grown() -> None:
    planner = HolePlanner(BS, PrefillMode.OFF, budget=0.5, decode_budget_blocks=4)
    planner.holes["r"] = HoleState(9, start=2, length=6, visible_from=0, owned=False)
    assert not planner.grow_for_decode("r", 9, 8 * BS, 40 * BS, step=1)
    assert planner.holes["r"].length == 6
    planner.holes["s"] = HoleState(9, start=2, length=6, visible_from=0)  # owned: grows
    assert planner.grow_for_decode("s", 9, 8 * BS, 40 * BS, step=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, "block_size"),
        ({"budget": 0.0}, "budget"),
        ({"budget": 1.5}, "budget"),
        ({"sink_blocks": 0}, "sink_blocks"),
        ({"decode_budget_blocks": 1}, "decode_budget_blocks"),
        ({"per_head_slack": 0.9}, "per_head_slack"),
        ({"protect_prompt": True}, "protect_prompt needs a decode budget"),
        (
            {"protect_prompt": True, "decode_budget_blocks": 8, "prefill_mode": PrefillMode.BLOCKS},
            "protect_prompt",
        ),
        (
            {"protect_prompt": True, "decode_budget_blocks": 8, "decode_recent_blocks": 4},
            "protect_prompt",
        ),  # a merging decode after a pack
    ],
)
def test_bad_settings_raise(kwargs: dict, match: str) -> None:
    args = {"block_size": BS, "prefill_mode": PrefillMode.PACK, "budget": 0.5, **kwargs}
    with pytest.raises(ValueError, match=match):
        HolePlanner(**args)


def decode_steps(
    planner: HolePlanner, prompt_len: int, advances: list[int]
) -> Iterator[tuple[int, HoleState | None]]:
    """Drive request "r" (first block 5) through decode steps that process ``advances``
    tokens each; yield its full blocks and hole after each step's growth."""
    processed = prompt_len
    for step, advance in enumerate(advances, start=1):
        processed += advance
        planner.grow_for_decode("r", 5, prompt_len, processed, step)
        yield processed // BS, planner.holes.get("r")


@settings(max_examples=60, deadline=None)
@given(
    prompt_blocks=st.integers(1, 40),
    extra=st.integers(0, 31),
    budget=st.sampled_from([0.25, 0.5, 0.75]),
    decode_budget=st.integers(2, 12),
    mode=st.sampled_from([PrefillMode.OFF, PrefillMode.PACK, PrefillMode.BLOCKS]),
    advances=st.lists(st.integers(1, 70), min_size=1, max_size=40),
)
def test_decode_keeps_budget_and_hole_invariants(
    prompt_blocks: int,
    extra: int,
    budget: float,
    decode_budget: int,
    mode: PrefillMode,
    advances: list[int],
) -> None:
    """After every step: the hole starts at block >= 1 and covers only processed full
    blocks; outside it stay at most max(decode budget, blocks before the hole) full blocks
    (the kept prefix itself is never dropped)."""
    planner = HolePlanner(BS, mode, budget=budget, decode_budget_blocks=decode_budget)
    prompt_len = prompt_blocks * BS + extra
    planner.prefill_end("r", prompt_len, 5, step=0)
    for full, hole in decode_steps(planner, prompt_len, advances):
        if hole is None:
            assert full <= decode_budget
            continue
        assert hole.start >= 1 and hole.stop <= full
        assert full - hole.length <= max(decode_budget, hole.start)


@settings(max_examples=60, deadline=None)
@given(
    prompt_blocks=st.integers(0, 40),
    extra=st.integers(0, 31),
    decode_budget=st.integers(3, 12),
    recent=st.sampled_from([None, 1]),
    mode=st.sampled_from([PrefillMode.OFF, PrefillMode.PACK]),
    advances=st.lists(st.integers(1, 70), min_size=1, max_size=40),
)
def test_protected_prompt_is_kept_and_the_budget_bounds_generated_blocks(
    prompt_blocks: int,
    extra: int,
    decode_budget: int,
    recent: int | None,
    mode: PrefillMode,
    advances: list[int],
) -> None:
    """``protect_prompt``: the prompt's kept full blocks never join the hole, and after every
    step at most the decode budget of other full blocks stays outside it."""
    recent = None if mode is PrefillMode.PACK else recent
    planner = HolePlanner(
        BS,
        mode,
        budget=0.25,
        decode_budget_blocks=decode_budget,
        decode_recent_blocks=recent,
        protect_prompt=True,
    )
    prompt_len = prompt_blocks * BS + extra
    planner.prefill_end("r", prompt_len, 5, step=0)
    packed = planner.holes.get("r")
    kept_prompt = prompt_blocks if packed is None else packed.start
    for full, hole in decode_steps(planner, prompt_len, advances):
        if hole is None or hole.length == 0:
            assert full - max(1, kept_prompt) <= decode_budget
            continue
        assert hole.start >= max(1, kept_prompt) and hole.stop <= full
        if packed is not None:
            assert hole.start == packed.start  # the pack's hole only grows at its end
        generated = full - hole.length - max(1, kept_prompt)
        assert generated <= decode_budget
        assert planner.protected_blocks(prompt_len, hole.start) == max(1, kept_prompt)
