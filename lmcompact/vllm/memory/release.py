"""Start-up of the ``"release"`` group: its hole geometry, and what it refuses.

:func:`make_planner` turns the validated options into the :class:`HolePlanner` both halves
share; :func:`refuse_under_tensor_parallel` and :func:`pack_budget_honoured_from` are the
start-up checks that need the engine (ranks, block size, ``max_model_len``).
"""

from __future__ import annotations

import logging

from lmcompact.vllm.config import BUDGET_TOLERANCE, ConnectorConfig
from lmcompact.vllm.memory.config import ReleaseOptions
from lmcompact.vllm.memory.planner import HolePlanner, PrefillMode

logger = logging.getLogger(__name__)


def make_planner(config: ConnectorConfig, block_size: int, max_model_len: int) -> HolePlanner:
    """The hole geometry of ``config.release`` (set) for the engine's block size.

    Raises:
        ValueError: a decode budget or recent span that is not block aligned, or a budget
            no in-place pack up to ``max_model_len`` can honour.
    """
    release = config.release
    assert release is not None
    planner = HolePlanner(
        block_size=block_size,
        prefill_mode=config.release_mode,
        budget=float(config.budget),
        sink_blocks=release.sink_blocks,
        decode_budget_blocks=release.decode_budget_blocks(block_size),
        min_prompt_blocks=max(2, release.min_prompt_tokens // block_size),
        per_head_slack=release.per_head_slack(),
        decode_recent_blocks=release.decode_recent_blocks(block_size),
    )
    if planner.prefill_mode is PrefillMode.PACK:
        honoured = pack_budget_honoured_from(planner, max_model_len)
        logger.info(
            "in-place packs keep whole blocks of %d tokens: budget %g is kept within %.0f%% "
            "for prompts of >= %s tokens; other lengths keep the nearest block count "
            "(each pack logs its kept / full tokens)",
            block_size,
            planner.budget,
            100 * BUDGET_TOLERANCE,
            "no length up to max_model_len: only some" if honoured is None else honoured,
        )
    return planner


def refuse_under_tensor_parallel(release: ReleaseOptions, tp_size: int) -> None:
    """Start-up refusal of the modes not made exact per tensor-parallel rank.

    Per-head counts are allocated over the heads a worker sees (a rank sees only its
    slice, so the allocation and the padded length would differ from one GPU's), and H2O
    decode merges were never checked across ranks; both are refused rather than run
    unverified. Uniform policies are per rank by construction: every (layer, head) keeps
    the same count, so one block table serves all ranks.
    """
    if tp_size == 1:
        return
    g = release.group
    refused = []
    if release.per_head is not None:
        refused.append(f"{g}.per_head (per-head counts)")
    if release.decode_policy == "h2o":
        refused.append(f"{g}.decode_policy 'h2o'")
    if refused:
        raise ValueError(
            f"{' and '.join(refused)} with tensor_parallel_size {tp_size}: "
            "not supported under tensor parallelism (each rank sees only its KV heads); "
            "use a uniform policy without per_head and decode_policy 'recent', or "
            "tensor_parallel_size 1"
        )


def pack_budget_honoured_from(planner: HolePlanner, max_model_len: int) -> int | None:
    """Prompt tokens from which every in-place pack keeps ``planner.budget`` within
    :data:`lmcompact.vllm.config.BUDGET_TOLERANCE` (None: only some lengths do).

    Packs keep whole blocks (``planner.kept_blocks``), so a prompt of ``F`` full blocks
    keeps about ``round(budget * F)``; short prompts cannot honour small budgets.

    Raises:
        ValueError: no prompt length up to ``max_model_len`` honours the budget.
    """
    budget, bs = planner.budget, planner.block_size
    lengths = range(planner.min_prompt_blocks, max_model_len // bs + 1)
    fine = [
        abs(planner.kept_blocks(nb) / nb - budget) <= BUDGET_TOLERANCE * budget for nb in lengths
    ]
    if not any(fine):
        largest = max(lengths.stop - 1, 1)
        raise ValueError(
            f"budget {budget:g} cannot be honoured by in-place packs of prompts up to "
            f"max_model_len {max_model_len} with block size {bs}: they keep whole blocks "
            f"(at best {planner.kept_blocks(largest)} of {largest}, "
            f"{planner.kept_blocks(largest) / largest:g}); raise the budget to at least "
            f"{1 / largest:g} or use a smaller block size"
        )
    if not fine[-1]:
        return None
    first = len(fine) - 1
    while first > 0 and fine[first - 1]:
        first -= 1
    return (lengths.start + first) * bs
