"""Run the Triton kernels in Triton's CPU interpreter against the torch references.

Started as a subprocess by ``test_interpreter.py`` (the interpreter must be
switched on before Triton kernels are defined). Exits non-zero on a mismatch.
Sizes are small: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from lmcompact.attention.scores import window_scores as window_scores_reference
from lmcompact.kernels import compaction_copy, paged_attention, window_scores
from lmcompact.kernels.entry_attention import (
    EntryLengths,
    attend_entries,
    entry_attention_reference,
)
from lmcompact.kernels.moves import compaction_moves, plan_defragment
from lmcompact.kernels.reference_paged import (
    move_slots_reference,
    paged_attention_reference,
)
from lmcompact.kernels.synthetic import densify, random_paged_case

FAILURES: list[str] = []


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    bad = not (err <= tol) or bool(torch.isnan(got).any())
    print(f"{'FAIL' if bad else 'ok  '} {name}: max abs err {err:.2e}")
    if bad:
        FAILURES.append(name)


def check_attention() -> None:
    cases = [
        # kept (B x Hkv), prefix, tail, q_len, group, block_size, layout, splits
        ([[5, 0, 1], [16, 7, 3]], [16, 32], [3, 9], [1, 1], 3, 4, "vllm", 3),
        ([[5, 0, 1], [16, 7, 3]], [16, 32], [3, 9], [1, 1], 3, 4, "flash", None),
        ([[0, 1], [9, 2]], [12, 16], [40, 33], [30, 33], 8, 4, "vllm", 2),
        ([[0], [0]], [0, 8], [1, 5], [1, 0], 1, 8, "flash", 1),
    ]
    for i, (kept, prefix, tail, q_len, group, bs, layout, splits) in enumerate(cases):
        case = random_paged_case(
            kept,
            prefix,
            tail,
            q_len,
            group=group,
            head_dim=32,
            block_size=bs,
            layout=layout,
            seed=i,
        )
        args = (
            case.queries,
            case.key_pool,
            case.value_pool,
            case.block_table,
            case.cu_seqlens_q,
            case.lengths,
        )
        want, want_mass = paged_attention_reference(*args, return_key_mass=True)
        got, mass = paged_attention.paged_attention(
            *args, return_key_mass=True, num_splits=splits, block_n=16
        )
        assert mass is not None and want_mass is not None
        check(f"paged attention case {i}", got, want)
        check(f"paged attention mass case {i}", mass, want_mass)


def check_dense() -> None:
    """Dense per-head cells (lmcompact.layout.paged): prefill and decode kernels over
    :func:`densify`'d batches equal the reference over the original slots."""
    cases = [
        # kept, prefix, tail, q_len, base, layout, splits, shrink (tail after the cells)
        ([[5, 4, 13], [16, 7, 30]], [16, 32], [3, 9], [1, 3], 0, "vllm", 2, False),
        ([[8, 4, 13], [16, 7, 30]], [16, 32], [5, 9], [5, 9], 4, "flash", None, False),
        ([[5, 4, 13], [16, 7, 30]], [16, 32], [3, 9], [1, 3], 0, "vllm", 2, True),
        ([[8, 4, 13], [16, 7, 30]], [16, 32], [5, 9], [5, 9], 4, "flash", None, True),
    ]
    for i, (kept, prefix, tail, q_len, base, layout, splits, shrink) in enumerate(cases):
        case = random_paged_case(
            kept, prefix, tail, q_len, group=2, head_dim=32, block_size=4, layout=layout, seed=i
        )
        dense = densify(case, base, shrink)
        want, _ = paged_attention_reference(*case.attention_args())
        got, _ = paged_attention.paged_attention(
            *dense.attention_args(),
            num_splits=splits,
            block_n=16,
        )
        check(f"dense cells case {i}", got, want)
    decode = random_paged_case(
        [[5, 4, 13], [16, 7, 30]], [16, 32], [3, 9], [1, 1], group=2, head_dim=32, block_size=4
    )
    dense = densify(decode, 0, shrink=True)
    want, _ = paged_attention_reference(*decode.attention_args())
    got = paged_attention.paged_decode_attention(
        *dense.attention_args(),
        scale=32**-0.5,
        num_splits=2,
    )
    check("dense cells decode kernel", got, want)


def check_entries() -> None:
    """Rows found by block lookup (lmcompact.kernels.entry_attention): request 1 of a dense
    batch is entry 2 of a table whose other entries are junk; request 0 has none, so its
    output rows must stay as the engine wrote them."""
    # a prefill chunk of two query tiles, its keys split three ways; then request 1 with
    # one head holding most keys, so balanced programs cross heads and split inside one
    runs = [([1, 1], 1), ([1, 1], 4), ([3, 9], 1), ([3, 9], 2), ([3, 40], 3)]
    runs += [([1, 1], 2), ([3, 40], 2)]
    for i, (q_len, splits) in enumerate(runs):
        long = i >= 5
        case = random_paged_case(
            [[5, 4, 13], [300, 20, 150] if long else [16, 7, 30]],
            [16, 320 if long else 32],
            [3, max(9, q_len[1] + 2)],
            q_len,
            group=2,
            head_dim=32,
            block_size=4,
            layout="vllm",
            seed=10 + i,
        )
        dense = densify(case, 4, shrink=True)
        queries, key_pool, value_pool, table, cu_q, lengths = dense.attention_args()
        assert lengths.dense_start is not None and lengths.dense_base is not None
        junk = torch.full((3, lengths.kept.shape[1]), 99, dtype=torch.int32)
        kept, cells = junk.clone(), junk.clone()
        kept[2], cells[2] = lengths.kept[1], lengths.dense_start[1]
        tail = torch.tensor([99, 99, int(lengths.tail_start[1])], dtype=torch.int32)
        base = torch.tensor([99, 99, int(lengths.dense_base[1])], dtype=torch.int32)
        entries = torch.full((key_pool.shape[0],), -1, dtype=torch.int32)
        entries[int(table[1, 0])] = 2
        tables = EntryLengths(entries, kept, cells, tail, base)
        engine_rows = torch.full_like(queries, 7.0)
        want, _ = paged_attention_reference(*case.attention_args(), scale=32**-0.5)
        mine = slice(int(cu_q[1]), int(cu_q[2]))
        for balanced in (False, True):  # each head's keys split, or all heads' end to end
            got = engine_rows.clone()
            attend_entries(
                queries,
                key_pool,
                value_pool,
                table,
                cu_q,
                lengths.seq_len,
                tables,
                got,
                scale=32**-0.5,
                num_reqs=2,
                max_q_len=max(q_len),
                num_splits=splits,
                balanced=balanced,
            )
            name = f"case {i}{' balanced' if balanced else ''}"
            check(f"entry rows {name}", got[mine], want[mine])
            check(
                f"entry rows left alone {name}",
                got[: int(cu_q[1])],
                engine_rows[: int(cu_q[1])],
                0.0,
            )
        ref = engine_rows.clone()
        entry_attention_reference(
            queries,
            key_pool,
            value_pool,
            table,
            cu_q,
            lengths.seq_len,
            tables,
            ref,
            scale=32**-0.5,
            num_reqs=2,
        )
        check(f"entry reference case {i}", ref, got)


def _int8_pool(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(block, slot, head) symmetric int8 of a ``(nb, bs, Hkv, D)`` pool, and its scales."""
    scale = pool.float().abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(pool.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def check_decode() -> None:
    """The fixed-grid decode kernel (device-side splits), float and int8 pools."""
    cases = [
        # kept (B x Hkv), prefix, tail, group, block_size, splits
        ([[5, 0, 1], [16, 7, 3]], [16, 32], [3, 9], 3, 4, 3),
        ([[0, 1], [9, 2]], [12, 16], [40, 33], 8, 4, 1),
        ([[0], [0], [0]], [0, 0, 0], [70, 1, 33], 4, 8, 4),
    ]
    for i, (kept, prefix, tail, group, bs, splits) in enumerate(cases):
        case = random_paged_case(
            kept, prefix, tail, [1] * len(prefix), group=group, head_dim=32, block_size=bs, seed=i
        )
        want, _ = paged_attention_reference(*case.attention_args())
        got = paged_attention.paged_decode_attention(
            *case.attention_args(),
            scale=32**-0.5,
            num_splits=splits,
        )
        check(f"decode kernel case {i}", got, want)
        qk, sk = _int8_pool(case.key_pool)
        qv, sv = _int8_pool(case.value_pool)
        want8, _ = paged_attention_reference(
            case.queries,
            qk,
            qv,
            case.block_table,
            case.cu_seqlens_q,
            case.lengths,
            key_scales=sk,
            value_scales=sv,
        )
        got8 = paged_attention.paged_decode_attention(
            case.queries,
            qk,
            qv,
            case.block_table,
            case.cu_seqlens_q,
            case.lengths,
            scale=32**-0.5,
            num_splits=splits,
            key_scales=sk,
            value_scales=sv,
        )
        check(f"decode kernel int8 case {i}", got8, want8)
        check(f"decode kernel int8 near float case {i}", got8, want, 0.1)


def check_window_scores() -> None:
    gen = torch.Generator().manual_seed(3)
    for b, hkv, group, w, t, d in ((1, 2, 3, 5, 70, 32), (2, 1, 8, 4, 33, 16)):
        q = torch.randn(b, hkv * group, w, d, generator=gen)
        k = torch.randn(b, hkv, t, d, generator=gen)
        want, _ = window_scores_reference(q, k)
        for reduce_each in (False, True):
            got = window_scores.window_scores(q, k, block_m=16, block_n=16, reduce_each=reduce_each)
            name = f"window scores b{b} hkv{hkv} g{group} w{w} t{t} reduce_each={reduce_each}"
            check(name, got, want)
    q = torch.randn(1, 4, 6, 16, generator=gen)
    k = torch.randn(1, 2, 40, 16, generator=gen)
    pos = torch.tensor([0, 3, 10, 20, 39, 39])
    want, _ = window_scores_reference(q, k, query_positions=pos)
    for reduce_each in (False, True):
        check(
            f"window scores custom positions reduce_each={reduce_each}",
            window_scores.window_scores(
                q, k, query_positions=pos, block_m=16, block_n=16, reduce_each=reduce_each
            ),
            want,
        )


def check_moves() -> None:
    case = random_paged_case(
        [[8, 3], [5, 8]],
        [8, 8],
        [4, 4],
        [1, 1],
        group=1,
        head_dim=32,
        block_size=4,
        poison=False,
        seed=7,
    )
    keep = [
        torch.tensor([1, 4, 7]),
        torch.tensor([0, 9, 10, 11]),
        torch.tensor([2]),
        torch.tensor([], dtype=torch.int64),
    ]
    moves = compaction_moves(keep, 2)
    table = case.block_table
    want_cache = case.cache.clone()
    wk, wv = want_cache[..., :32].transpose(1, 2), want_cache[..., 32:].transpose(1, 2)
    move_slots_reference(wk, wv, table, wk, wv, table, moves)
    compaction_copy.move_slots(
        case.key_pool, case.value_pool, table, case.key_pool, case.value_pool, table, moves
    )
    check("compaction in place (staged)", case.cache, want_cache, 0.0)
    dst = torch.zeros_like(case.cache)
    dk, dv = dst[..., :32].transpose(1, 2), dst[..., 32:].transpose(1, 2)
    want_dst = torch.zeros_like(case.cache)
    rk, rv = want_dst[..., :32].transpose(1, 2), want_dst[..., 32:].transpose(1, 2)
    move_slots_reference(case.key_pool, case.value_pool, table, rk, rv, table, moves)
    compaction_copy.move_slots(case.key_pool, case.value_pool, table, dk, dv, table, moves)
    check("compaction into another pool", dst, want_dst, 0.0)
    plan = plan_defragment(table, case.lengths, 4)
    print(f"     defrag: blocks {plan.blocks_before} -> {plan.blocks_after}")


if __name__ == "__main__":
    check_attention()
    check_decode()
    check_dense()
    check_entries()
    check_window_scores()
    check_moves()
    sys.exit(1 if FAILURES else 0)
