"""Triton kernels against their torch references on CUDA (skipped without a GPU).

bf16 and fp16, GQA ratios 1 / 3 / 8, head_dim 64 and 128, ragged per-head
lengths with empty and single-token heads, both pool layouts. Errors are
relative: ``||got - ref|| / ||ref||`` with the reference computed in fp32 from
the same low-precision inputs.
"""

from __future__ import annotations

import pytest
import torch

from lmcompact.attention.scores import window_scores as window_scores_reference
from lmcompact.kernels import dispatch
from lmcompact.kernels.moves import compaction_moves
from lmcompact.kernels.reference_paged import move_slots_reference, paged_attention_reference
from lmcompact.kernels.synthetic import densify, random_paged_case
from lmcompact.layout.paged import vllm_kv_views
from tests.gpu.errors import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def ragged_kept(batch: int, hkv: int, prefix: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    kept = torch.randint(0, prefix + 1, (batch, hkv), generator=gen)
    kept[0, 0] = 0  # empty head
    kept[-1, -1] = 1  # single-token head
    if hkv > 1:
        kept[0, 1] = prefix  # nothing dropped
    return kept.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_paged_attention_matches_reference(
    dtype: torch.dtype, group: int, head_dim: int, mode: str
) -> None:
    batch, hkv, bs = 3, 4, 16
    prefix = [256, 512, 0]
    kept = ragged_kept(batch, hkv, 256, seed=group * head_dim)
    kept[1] = [min(512, 2 * k) for k in kept[1]]
    kept[2] = [0] * hkv  # a request that was never compacted
    if mode == "decode":
        tail, q_len = [5, 33, 70], [1, 1, 1]
    else:
        tail, q_len = [40, 100, 90], [40, 17, 90]
    layout = "vllm" if (group + head_dim) % 2 else "flash"
    case = random_paged_case(
        kept,
        prefix,
        tail,
        q_len,
        group=group,
        head_dim=head_dim,
        block_size=bs,
        layout=layout,
        dtype=dtype,
        device="cuda",
        seed=head_dim + group,
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
    got, mass = dispatch.paged_attention(*args, return_key_mass=True)
    assert mass is not None and want_mass is not None
    assert rel_err(got, want) < TOL[dtype]
    assert rel_err(mass, want_mass) < TOL[dtype]
    assert float((mass - want_mass).abs().max()) < 0.05 * len(q_len) * max(q_len)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("base", [0, 32])
def test_dense_cells_match_reference_over_the_original_slots(
    dtype: torch.dtype, mode: str, base: int
) -> None:
    """Heads' kept keys as dense cells with the tail moved up against them (heads keeping
    more keys than the slots before the tail): the Triton kernel over the cells equals the
    reference over the padded slots they came from."""
    batch, hkv, bs = 3, 8, 16
    prefix = [1024, 512, 256]
    kept = ragged_kept(batch, hkv, 256, seed=7 + base)
    grow = [4, 2, 1]  # longer prefixes keep more; every head keeps the base slots
    kept = [
        [min(p, g * k + base) for k in row] for p, g, row in zip(prefix, grow, kept, strict=True)
    ]
    tail, q_len = ([5, 33, 70], [1, 1, 1]) if mode == "decode" else ([40, 100, 90], [40, 17, 90])
    case = random_paged_case(
        kept,
        prefix,
        tail,
        q_len,
        group=4,
        head_dim=128,
        block_size=bs,
        dtype=dtype,
        device="cuda",
        seed=base,
    )
    dense = densify(case, base, shrink=True)
    assert bool((dense.lengths.tail_start < prefix_tensor(prefix)).all())  # blocks went back
    want, _ = paged_attention_reference(*case.attention_args())
    got, _ = dispatch.paged_attention(*dense.attention_args())
    assert not torch.isnan(got).any()
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("balanced", [False, True])
def test_entry_attention_replayed_from_a_cuda_graph(dtype: torch.dtype, balanced: bool) -> None:
    """The per-head launch of the vLLM connector (lmcompact.kernels.entry_attention) is
    captured once with no per-head request in its tables, then replayed after the tables
    (not the graph) turn requests 0 and 2 on: their rows equal the reference over the
    original slots, request 1's rows stay as the engine wrote them. ``balanced``: the
    heads' keys split end to end (lmcompact.kernels.entry_balanced)."""
    from lmcompact.kernels.entry_attention import EntryLengths, attend_entries, entry_splits

    batch, hkv, bs = 3, 8, 16
    prefix = [1024, 512, 256]
    kept = [
        [min(p, 2 * k + 32) for k in row]
        for p, row in zip(prefix, ragged_kept(batch, hkv, 256, 3), strict=True)
    ]
    case = random_paged_case(
        kept,
        prefix,
        [5, 33, 70],
        [1, 1, 1],
        group=4,
        head_dim=128,
        block_size=bs,
        dtype=dtype,
        device="cuda",
        seed=5,
    )
    dense = densify(case, 32, shrink=True)
    queries, key_pool, value_pool, table, cu_q, lengths = dense.attention_args()
    assert lengths.dense_start is not None and lengths.dense_base is not None
    capacity = 4
    tables = EntryLengths(
        torch.full((key_pool.shape[0],), -1, dtype=torch.int32, device="cuda"),
        torch.zeros(capacity, hkv, dtype=torch.int32, device="cuda"),
        torch.zeros(capacity, hkv, dtype=torch.int32, device="cuda"),
        torch.zeros(capacity, dtype=torch.int32, device="cuda"),
        torch.zeros(capacity, dtype=torch.int32, device="cuda"),
    )
    engine_rows = torch.randn_like(queries)
    out = engine_rows.clone()
    splits = entry_splits(batch, 1, hkv, queries.shape[1], 128, batch, 4096, queries.device)

    def launch() -> None:
        attend_entries(
            queries,
            key_pool,
            value_pool,
            table,
            cu_q,
            lengths.seq_len,
            tables,
            out,
            scale=128**-0.5,
            num_reqs=batch,
            max_q_len=1,
            num_splits=splits,
            balanced=balanced,
        )

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    assert torch.equal(out, engine_rows)  # empty tables: nothing written
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for entry, b in ((3, 0), (1, 2)):  # after capture, as the connector's sync does
        tables.kept[entry] = lengths.kept[b].to(torch.int32)
        tables.cells[entry] = lengths.dense_start[b].to(torch.int32)
        tables.tail_start[entry] = int(lengths.tail_start[b])
        tables.base[entry] = int(lengths.dense_base[b])
        tables.entries[int(table[b, 0])] = entry
    graph.replay()
    torch.cuda.synchronize()
    want, _ = paged_attention_reference(*case.attention_args(), scale=128**-0.5)
    for b in (0, 2):
        assert rel_err(out[b : b + 1], want[b : b + 1]) < TOL[dtype]
    assert torch.equal(out[1], engine_rows[1])


def prefix_tensor(prefix: list[int]) -> torch.Tensor:
    return torch.tensor(prefix, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 7])
def test_paged_decode_splits_agree(dtype: torch.dtype, splits: int) -> None:
    from lmcompact.kernels import paged_attention as kernel

    kept = ragged_kept(4, 2, 1024, seed=splits)
    case = random_paged_case(
        kept,
        [1024] * 4,
        [3, 1, 64, 9],
        [1] * 4,
        group=4,
        head_dim=128,
        block_size=32,
        dtype=dtype,
        device="cuda",
        seed=splits,
    )
    args = (
        case.queries,
        case.key_pool,
        case.value_pool,
        case.block_table,
        case.cu_seqlens_q,
        case.lengths,
    )
    want, _ = paged_attention_reference(*args)
    got, _ = kernel.paged_attention(*args, num_splits=splits)
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_window_scores_match_reference(dtype: torch.dtype, group: int, head_dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(group * 7 + head_dim)
    hkv, w, t = 2, 32, 1000
    q = torch.randn(2, hkv * group, w, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(2, hkv, t, head_dim, device="cuda", generator=gen).to(dtype)
    want, _ = window_scores_reference(q, k)
    got = dispatch.window_scores(q, k)
    assert got.shape == (2, hkv, t) and got.dtype == torch.float32
    assert rel_err(got, want) < TOL[dtype]
    # total mass per kv head is W (every window query's row sums to one)
    assert torch.allclose(got.sum(-1), torch.full_like(got.sum(-1), float(w)), rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_scores_autotuned_long_sequence(dtype: torch.dtype) -> None:
    """From TUNE_MIN_TOKENS on the autotuned launch runs; every config it tries must agree."""
    from lmcompact.kernels import window_scores as kernel

    gen = torch.Generator(device="cuda").manual_seed(17)
    t = kernel.TUNE_MIN_TOKENS + 1000
    q = torch.randn(1, 8, 16, 128, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, 2, t, 128, device="cuda", generator=gen).to(dtype)
    want, _ = window_scores_reference(q, k)
    assert rel_err(dispatch.window_scores(q, k), want) < TOL[dtype]
    for reduce_each in (False, True):
        for warps in (4, 8):
            got = kernel.window_scores(q, k, reduce_each=reduce_each, num_warps=warps, num_stages=1)
            assert rel_err(got, want) < TOL[dtype], (reduce_each, warps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_scores_short_window_and_positions(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, 6, 3, 64, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, 2, 300, 64, device="cuda", generator=gen).to(dtype)
    pos = torch.tensor([0, 150, 299], device="cuda")
    want, _ = window_scores_reference(q, k, query_positions=pos)
    got = dispatch.window_scores(q, k, query_positions=pos)
    assert rel_err(got, want) < TOL[dtype]
    assert float(got[..., 151:299].abs().max()) <= float(got[..., 299].abs().max()) + 10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [True, False])
def test_compaction_copy_matches_reference(dtype: torch.dtype, in_place: bool) -> None:
    kept = ragged_kept(3, 4, 256, seed=11)
    case = random_paged_case(
        kept,
        [256] * 3,
        [20] * 3,
        [1] * 3,
        group=1,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        device="cuda",
        poison=False,
        seed=11,
    )
    gen = torch.Generator(device="cuda").manual_seed(12)
    keep = [
        torch.nonzero(torch.rand(k, device="cuda", generator=gen) < 0.4).flatten()
        for row in kept
        for k in row
    ]
    keep[5] = torch.tensor([0], device="cuda")
    moves = compaction_moves(keep, 4)
    want = case.cache.clone()
    wk, wv = vllm_kv_views(want)
    if in_place:
        move_slots_reference(wk, wv, case.block_table, wk, wv, case.block_table, moves)
        counts = dispatch.compact_heads(case.key_pool, case.value_pool, case.block_table, keep)
        assert torch.equal(case.cache, want)
    else:
        dst = torch.zeros_like(case.cache)
        dk, dv = vllm_kv_views(dst)
        ref = torch.zeros_like(case.cache)
        rk, rv = vllm_kv_views(ref)
        move_slots_reference(wk, wv, case.block_table, rk, rv, case.block_table, moves)
        counts = dispatch.compact_heads(
            case.key_pool,
            case.value_pool,
            case.block_table,
            keep,
            dst_keys=dk,
            dst_values=dv,
            dst_table=case.block_table,
        )
        assert torch.equal(dst, ref)
    assert counts.tolist() == [[k.numel() for k in keep[i : i + 4]] for i in (0, 4, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_defragment_preserves_attention(dtype: torch.dtype) -> None:
    kept = ragged_kept(4, 2, 512, seed=21)
    case = random_paged_case(
        kept,
        [512] * 4,
        [30, 1, 17, 64],
        [1] * 4,
        group=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device="cuda",
        poison=False,
        seed=21,
    )
    args = (case.queries, case.key_pool, case.value_pool)
    before, _ = dispatch.paged_attention(*args, case.block_table, case.cu_seqlens_q, case.lengths)
    plan = dispatch.defragment(case.key_pool, case.value_pool, case.block_table, case.lengths)
    after, _ = dispatch.paged_attention(
        *args, plan.block_table.to(torch.int32), case.cu_seqlens_q, plan.lengths
    )
    assert plan.blocks_after < plan.blocks_before
    assert int(plan.block_table.max()) < plan.blocks_after
    assert rel_err(after, before) < 1e-3


def test_force_reference_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dispatch.use_kernels(torch.device("cuda"))
    with dispatch.force_reference():
        assert not dispatch.use_kernels(torch.device("cuda"))
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    assert not dispatch.use_kernels(torch.device("cuda"))
    with dispatch.force_reference(False):
        assert dispatch.use_kernels(torch.device("cuda"))
