"""Compaction on top of a paged cache: plan with any policy, pack, free whole blocks.

At the end of prefill the cache holds every prompt token. The observer records
what the policy reads (window attention captured inside the prefill attention;
keys are read back from the pool), and before the first decode step the cache
plans every layer at once and packs each head's kept tokens at the front of
the row's blocks::

    before   slots [t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 t10 t11 | t12 ... ]   4 blocks
    head 0   keeps  t0 t3 t9 t12 t13 t14         ->  [t0 t3 t9 t12 | t13 t14 . . ]
    head 1   keeps  t0 t1 t2 t11 t13 t14         ->  [t0 t1 t2 t11 | t13 t14 . . ]
    after    tail_start = 8 (2 blocks); blocks 3 and 4 go back to the pool

Rows that share blocks (beams of one prompt) are planned and packed once. The
move reads every kept token before writing any, so packing in place is safe;
blocks also held by rows outside the group are never written (the packed
copy goes to fresh blocks instead). int8 tokens move with their scales.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from lmcompact.compaction.policy_inputs import (
    compaction_inputs,
    layer_observation,
    prompt_observations,
)
from lmcompact.hf.paged.blocks import BlockPool
from lmcompact.hf.paged.storage import KVStorage
from lmcompact.hf.paged.table import BlockTable, allocate_cleared
from lmcompact.plan import KeepPlan
from lmcompact.policies import CompactionPolicy, LayerObservation, Need, Phase

if TYPE_CHECKING:
    from lmcompact.hf.paged.layer import PagedLayer

logger = logging.getLogger(__name__)

SUPPORTED_NEEDS = Need.KEYS | Need.WINDOW_SCORES | Need.WINDOW_ATTENTION | Need.CUMULATIVE_SCORES
DEFAULT_WINDOW = 32


class PrefillObserver:
    """Captures the prefill attention statistics a policy needs, per layer.

    The statistics come from
    :func:`lmcompact.compaction.policy_inputs.prompt_observations` (the same capture the
    ragged ``Cache`` uses); the keys are read back from the pool when the policy plans.

    Args:
        policy: The compaction policy (must apply at prefill).
        window_size: Observation window W (default: the policy's
            ``window_size`` attribute, else 32).
    """

    def __init__(self, policy: CompactionPolicy, window_size: int | None = None) -> None:
        if Phase.PREFILL not in policy.phases:
            raise ValueError(
                f"policy {policy.name!r} applies at {policy.phases}; PagedCache compacts at the "
                "end of prefill, so the policy must include Phase.PREFILL"
            )
        unsupported = policy.needs & ~SUPPORTED_NEEDS
        if unsupported:
            raise ValueError(
                f"policy {policy.name!r} needs {unsupported}, which PagedCache does not "
                f"capture; supported: {SUPPORTED_NEEDS}"
            )
        window = window_size if window_size is not None else getattr(policy, "window_size", None)
        self.policy = policy
        self.window = int(window) if window else DEFAULT_WINDOW
        if self.window <= 0:
            raise ValueError(f"window_size must be > 0, got {self.window}")
        self.layers: dict[int, list[LayerObservation]] = {}
        self.pending = False

    def observe_prefill(
        self, layer: PagedLayer, query: torch.Tensor, key: torch.Tensor, scale: float
    ) -> None:
        """Record one layer's prefill statistics (``query (B, Hq, T, D)``).

        Rows stored once (beams of one prompt) are scored once, from row 0.
        """
        table = layer.table
        shared = table is not None and bool((table.blocks == table.blocks[:1]).all())
        rows = 1 if shared else query.shape[0]
        self.layers[layer.layer_idx] = prompt_observations(
            self.policy.needs, query[:rows], key[:rows], window=self.window, scale=scale
        )
        self.pending = True


def _groups(table: BlockTable) -> list[list[int]]:
    """Rows with identical block ids, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, ids in enumerate(table.blocks.tolist()):
        groups.setdefault(tuple(ids), []).append(row)
    return list(groups.values())


def candidate_slots(table: BlockTable, row: int, head: int) -> torch.Tensor:
    """Slots a head currently uses: ``[0, kept) ++ [tail_start, num_slots)``."""
    kept = int(table.kept[row, head])
    return torch.cat([torch.arange(kept), torch.arange(table.tail_start, table.num_slots)])


def compact_layers(
    layers: list[PagedLayer],
    observer: PrefillObserver,
    pool: BlockPool,
    storage: KVStorage,
) -> KeepPlan:
    """Plan every layer with the observer's policy and pack the kept tokens.

    Rows of layer 0 with identical block tables are planned once (they are
    beams of one prompt). Returns the plan of the first row group.

    Raises:
        ValueError: when rows differ (each needs its own plan) and the layers
            disagree on the grouping, or the plan does not fit the cache.
    """
    first = layers[0].table
    assert first is not None
    groups = _groups(first)
    plans: list[KeepPlan] = []
    for rows in groups:
        plans.append(_plan_row(layers, observer, storage, rows[0]))
    for index, layer in enumerate(layers):
        assert layer.table is not None
        if _groups(layer.table) != groups:
            raise ValueError(
                f"layer {index} groups its rows as {_groups(layer.table)}, layer 0 as {groups}"
            )
        _apply(
            layer,
            [(rows, plan.kept[index]) for rows, plan in zip(groups, plans, strict=True)],
            pool,
            storage,
        )
    observer.layers.clear()
    observer.pending = False
    return plans[0]


def _plan_row(
    layers: list[PagedLayer], observer: PrefillObserver, storage: KVStorage, row: int
) -> KeepPlan:
    needs = observer.policy.needs
    observations = []
    table0 = layers[0].table
    assert table0 is not None
    t = table0.num_slots
    for layer in layers:
        table = layer.table
        assert table is not None
        if table.tail_start != 0 or table.num_slots != t:
            raise ValueError("prefill compaction needs every layer uncompacted and equally long")
        captured = observer.layers.get(layer.layer_idx, [LayerObservation()])
        keys = values = None
        if needs & Need.KEYS:
            keys, values = storage.read_slots(*table.addresses(row, torch.arange(t)))
        observed = captured[row] if len(captured) > 1 else captured[0]
        observations.append(layer_observation(needs, keys, values, observed=observed))
    inputs = compaction_inputs(needs, observations, t, table0.num_kv_heads)
    plan = observer.policy.plan(inputs)
    plan.validate_for(len(layers), table0.num_kv_heads, t)
    return plan


def _apply(
    layer: PagedLayer,
    group_plans: list[tuple[list[int], tuple[torch.Tensor, ...]]],
    pool: BlockPool,
    storage: KVStorage,
) -> None:
    """Pack each group's kept candidates to slots ``[0, n)`` and free whole blocks."""
    table = layer.table
    assert table is not None
    bs = table.block_size
    counts = [max(int(k.numel()) for k in kept) for _, kept in group_plans]
    tail_start = -(-max(counts) // bs) * bs
    width = tail_start // bs
    new_blocks = torch.empty(table.batch_size, width, dtype=torch.int64)
    new_kept = torch.zeros_like(table.kept)
    new_positions = torch.zeros(table.batch_size, table.num_kv_heads, tail_start, dtype=torch.int64)
    for rows, kept in group_plans:
        row = rows[0]
        old = table.blocks[row]
        exclusive = bool((pool.refcount[old] == len(rows)).all())
        if exclusive:
            dst = old[:width].clone()
        else:
            dst = allocate_cleared(pool, storage, width)
            pool.incref(dst.repeat(len(rows) - 1))
        heads, src_b, src_o, dst_b, dst_o = [], [], [], [], []
        positions = _candidate_positions(layer, table, row)
        for head, chosen in enumerate(kept):
            slots = candidate_slots(table, row, head)[chosen]
            n = slots.numel()
            target = torch.arange(n)
            heads.append(torch.full((n,), head, dtype=torch.int64))
            src_b.append(old[slots // bs])
            src_o.append(slots % bs)
            dst_b.append(dst[target // bs])
            dst_o.append(target % bs)
            new_kept[rows, head] = n
            new_positions[rows, head, :n] = positions[head][chosen]
        storage.move_tokens(
            torch.cat(heads),
            (torch.cat(src_b), torch.cat(src_o)),
            (torch.cat(dst_b), torch.cat(dst_o)),
        )
        dropped = old[width:] if exclusive else old
        pool.decref(dropped.repeat(len(rows)))
        new_blocks[rows] = dst
    table.blocks = new_blocks
    table.kept = new_kept
    table.tail_start = tail_start
    table.num_slots = tail_start
    layer.kept_positions = new_positions


def _candidate_positions(layer: PagedLayer, table: BlockTable, row: int) -> list[torch.Tensor]:
    """Original positions of each head's candidate slots."""
    tail = torch.arange(table.tail_start, table.num_slots) + (layer.seen - table.num_slots)
    out = []
    for head in range(table.num_kv_heads):
        kept = int(table.kept[row, head])
        head_kept = (
            layer.kept_positions[row, head, :kept]
            if layer.kept_positions is not None
            else torch.zeros(0, dtype=torch.int64)
        )
        out.append(torch.cat([head_kept, tail]))
    return out
