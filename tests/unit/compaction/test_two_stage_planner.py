"""Two-stage loads in the hole planner: a loaded selection packed again at prefill end."""

from __future__ import annotations

from lmcompact.compaction.hole_planner import HolePlanner, Pack, PrefillMode
from lmcompact.compaction.holes import HoleState

BS = 32


def planner(budget: float = 0.25) -> HolePlanner:
    return HolePlanner(block_size=BS, prefill_mode=PrefillMode.PACK, budget=budget)


def load_hole(p: HolePlanner, start: int, length: int) -> HoleState:
    """What a compacted store load opens: kept rows in [0, start), hole after."""
    hole = HoleState(first_block=7, start=start, length=length, visible_from=3, owned=False)
    p.holes["r"] = hole
    return hole


def test_repack_replaces_the_load_hole_from_the_final_budget_to_the_prompt_end() -> None:
    p = planner(0.25)
    old = load_hole(p, start=16, length=16)  # 32 loaded blocks stored at 0.5
    prompt_len = 34 * BS + 5  # 2 full tail blocks and a partial one
    planned = p.repack("r", prompt_len, step=5)
    assert planned is not None
    pack, replaced = planned
    assert replaced is old
    kb = round(0.25 * 34)
    # the pack reads the blocks outside the load's hole: 16 kept + 2 tail blocks
    assert pack == Pack("r", 18 * BS, kb * BS, kb * BS, 0)
    new = p.holes["r"]
    assert (new.start, new.stop, new.owned) == (kb, 34, True)
    assert new.first_block == 7 and new.visible_from == 6  # skipped from the next step


def test_no_repack_when_the_final_budget_reaches_the_loaded_rows() -> None:
    p = planner(0.5)
    load_hole(p, start=8, length=24)  # stored at 0.25: 8 kept of 32
    assert p.repack("r", 33 * BS, step=1) is None  # 0.5 of 33 = 16 blocks > 8 kept
    assert p.holes["r"].owned is False  # the load's hole stays


def test_no_repack_without_a_load_hole_or_outside_pack_mode() -> None:
    p = planner()
    assert p.repack("r", 40 * BS, step=1) is None
    p.holes["r"] = HoleState(first_block=7, start=4, length=8, visible_from=1)  # owned
    assert p.repack("r", 40 * BS, step=1) is None
    blocks = HolePlanner(block_size=BS, prefill_mode=PrefillMode.BLOCKS, budget=0.25)
    blocks.holes["r"] = HoleState(7, 16, 16, visible_from=1, owned=False)
    assert blocks.repack("r", 40 * BS, step=1) is None
