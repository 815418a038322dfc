"""The measurements of ``lmcompact bench kernels``: one dict of timings per case.

window_row        window scores at one T: kernel vs SDPA vs the eager full matrix
decode_rows       ragged and uniform per-head paged decode vs copy bandwidth and SDPA
compaction_rows   packing kept tokens vs copy bandwidth, and defragmentation
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from lmcompact.bench.gpu_timing import bench, bench_graph, sdpa, time_sdpa

log = logging.getLogger(__name__)


def window_row(t: int, w: int, args: argparse.Namespace, eager: bool) -> dict[str, Any]:
    import torch

    from lmcompact.attention.scores import window_scores_naive
    from lmcompact.kernels import window_scores as ws

    hq, hkv, d = 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(t)
    q = torch.randn(1, hq, w, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, hkv, t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    row: dict[str, Any] = {"T": t, "W": w, "q_heads": hq, "kv_heads": hkv, "head_dim": d}
    row["kernel_ms"] = bench(lambda: ws.window_scores(q, k))
    bucket = 1 << (t - 1).bit_length()
    row["tuned_configs"] = [  # pass 1 and pass 2, as the autotuner chose them for this T
        str(config) for key, config in ws._tuned_pass_kernel.cache.items() if key[0] == bucket
    ]
    row["sdpa_ms"], row["sdpa_backend"] = time_sdpa(q, k, v)
    row["kernel_graph_ms"] = bench_graph(lambda: ws.window_scores(q, k))
    row["sdpa_graph_ms"] = bench_graph(lambda: sdpa(q, k, v))
    row["vs_sdpa"] = row["kernel_ms"] / row["sdpa_ms"]
    if eager:
        row["eager_ms"] = bench(lambda: window_scores_naive(q, k), rep=50)
        row["vs_eager"] = row["eager_ms"] / row["kernel_ms"]
    row["K_bytes"] = k.numel() * k.element_size()
    if args.variants and t == args.seq_len:
        variants: list[dict[str, Any]] = []
        for bm, bn, nw, ns, reduce_each in (
            (64, 128, 4, 2, False),
            (64, 128, 4, 2, True),
            (64, 128, 8, 2, True),
            (128, 128, 8, 2, True),
            (128, 128, 8, 3, True),
            (64, 64, 4, 3, True),
            (64, 256, 8, 2, True),
            (128, 256, 8, 2, True),
        ):
            ms = bench(
                lambda bm=bm, bn=bn, nw=nw, ns=ns, re=reduce_each: ws.window_scores(
                    q, k, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, reduce_each=re
                )
            )
            variants.append(
                {
                    "block_m": bm,
                    "block_n": bn,
                    "num_warps": nw,
                    "num_stages": ns,
                    "reduce_each": reduce_each,
                    "ms": ms,
                }
            )
        row["variants"] = variants
    return row


def decode_case(
    batch: int,
    prefix: int,
    ragged: bool,
    seed: int,
    *,
    kept_range: tuple[float, float] = (0.25, 1.0),
    hold_hole: bool = False,
) -> dict[str, Any]:
    """A large compacted decode batch built on the GPU (random data).

    Kept counts per head are uniform in ``kept_range * prefix`` (ragged) or half
    the prefix (uniform). With ``hold_hole`` the hole keeps distinct blocks (a
    request that has not given them back yet), else its entries share one block.
    """
    import torch

    from lmcompact.layout.paged import PagedLengths, vllm_kv_views

    hkv, group, d, bs, tail = 8, 4, 128, 16, 64
    gen = torch.Generator().manual_seed(seed)
    if ragged:
        lo, hi = kept_range
        kept = (torch.rand(batch, hkv, generator=gen) * (hi - lo) + lo) * prefix
        kept = kept.long().clamp(1, prefix)
        kept[0, 0] = 0  # an empty head
        kept[0, 1] = 1  # a single-token head
    else:
        kept = torch.full((batch, hkv), prefix // 2, dtype=torch.long)
    kept_blocks = -(-kept.max(dim=1).values // bs)
    tail_blocks = -(-tail // bs)
    width = prefix // bs + tail_blocks
    num_blocks = int(kept_blocks.sum()) + batch * tail_blocks + 1
    if hold_hole:
        num_blocks = batch * width
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((batch, width), int(order[-1]), dtype=torch.int32)
    nxt = 0
    for b in range(batch):
        n = width if hold_hole else int(kept_blocks[b])
        table[b, :n] = order[nxt : nxt + n].to(torch.int32)
        nxt += n
        if not hold_hole:
            table[b, prefix // bs :] = order[nxt : nxt + tail_blocks].to(torch.int32)
            nxt += tail_blocks
    cache = torch.randn(num_blocks, hkv, bs, 2 * d, dtype=torch.bfloat16, device="cuda")
    k_pool, v_pool = vllm_kv_views(cache)
    lengths = PagedLengths(
        kept=kept.to(torch.int32).cuda(),
        tail_start=torch.full((batch,), prefix, dtype=torch.int32, device="cuda"),
        seq_len=torch.full((batch,), prefix + tail, dtype=torch.int32, device="cuda"),
    )
    queries = torch.randn(batch, hkv * group, d, dtype=torch.bfloat16, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return {
        "queries": queries,
        "cache": cache,
        "k": k_pool,
        "v": v_pool,
        "table": table.cuda(),
        "cu": cu,
        "lengths": lengths,
        "group": group,
    }


def decode_rows(args: argparse.Namespace, copy_gbps: float) -> dict[str, Any]:
    import torch

    from lmcompact.kernels import paged_attention as pa

    result: dict[str, Any] = {}
    for ragged in (True, False):
        c = decode_case(args.decode_batch, args.decode_prefix, ragged, seed=1)
        lengths = c["lengths"]
        visible = int(lengths.visible().sum())
        max_visible = int(lengths.visible().max())
        d = c["queries"].shape[-1]
        kv_bytes = visible * 2 * d * 2
        io_bytes = 2 * c["queries"].numel() * 2
        call_args = (c["queries"], c["k"], c["v"], c["table"], c["cu"], lengths)
        ms = bench(
            lambda a=call_args, mv=max_visible: pa.paged_attention(*a, max_q_len=1, max_visible=mv)
        )
        graph_ms = bench_graph(
            lambda a=call_args, mv=max_visible: pa.paged_attention(*a, max_q_len=1, max_visible=mv)
        )
        mass_ms = bench(
            lambda a=call_args, mv=max_visible: pa.paged_attention(
                *a, max_q_len=1, max_visible=mv, return_key_mass=True
            )
        )
        b, hq, _ = c["queries"].shape
        hkv = hq // c["group"]
        dense_len = max(1, round(visible / (b * hkv)))
        dk = torch.randn(b, hkv, dense_len, d, dtype=torch.bfloat16, device="cuda")
        dv = torch.randn_like(dk)
        dq = c["queries"].view(b, hq, 1, d)
        sdpa_ms, backend = time_sdpa(dq, dk, dv)
        row: dict[str, Any] = {
            "batch": b,
            "q_heads": hq,
            "kv_heads": hkv,
            "head_dim": d,
            "block_size": 16,
            "layout": "vllm-0.26 (num_blocks, kv_heads, block_size, 2*head_dim)",
            "prefix": args.decode_prefix,
            "visible_tokens": visible,
            "kv_bytes": kv_bytes,
            "ms": ms,
            "GBps": (kv_bytes + io_bytes) / ms / 1e6,
            "bw_fraction": (kv_bytes + io_bytes) / ms / 1e6 / copy_gbps,
            "graph_ms": graph_ms,
            "with_key_mass_ms": mass_ms,
            "dense_sdpa_tokens_per_head": dense_len,
            "dense_sdpa_ms": sdpa_ms,
            "dense_sdpa_backend": backend,
            "vs_dense_sdpa": ms / sdpa_ms,
        }
        if args.variants and ragged:
            variants: list[dict[str, Any]] = []
            for bn, nw, ns, splits in (
                (64, 4, 3, None),
                (128, 4, 3, None),
                (128, 4, 4, None),
                (128, 8, 3, None),
                (128, 4, 3, 4),
                (128, 4, 3, 16),
                (128, 4, 3, 32),
            ):
                try:
                    v_ms = bench(
                        lambda a=call_args, mv=max_visible, bn=bn, nw=nw, ns=ns, sp=splits: (
                            pa.paged_attention(
                                *a,
                                max_q_len=1,
                                max_visible=mv,
                                block_n=bn,
                                num_warps=nw,
                                num_stages=ns,
                                num_splits=sp,
                            )
                        )
                    )
                except Exception as exc:  # a config that does not compile is reported
                    variants.append(
                        {
                            "block_n": bn,
                            "num_warps": nw,
                            "num_stages": ns,
                            "num_splits": splits,
                            "error": repr(exc)[:200],
                        }
                    )
                    continue
                variants.append(
                    {
                        "block_n": bn,
                        "num_warps": nw,
                        "num_stages": ns,
                        "num_splits": splits,
                        "ms": v_ms,
                        "bw_fraction": (kv_bytes + io_bytes) / v_ms / 1e6 / copy_gbps,
                    }
                )
            row["variants"] = variants
        result["ragged" if ragged else "uniform"] = row
        del c, dk, dv, call_args
        torch.cuda.empty_cache()
    return result


def compaction_rows(args: argparse.Namespace, copy_gbps: float) -> dict[str, Any]:
    import time

    import torch

    from lmcompact.kernels import compaction_copy as cc
    from lmcompact.kernels.moves import compaction_moves, plan_defragment

    c = decode_case(args.decode_batch, args.decode_prefix, ragged=True, seed=2)
    k, v, table, lengths = c["k"], c["v"], c["table"], c["lengths"]
    b, hkv = lengths.kept.shape
    gen = torch.Generator(device="cuda").manual_seed(3)
    keep = []
    kept_cpu = lengths.kept.cpu()
    for s in range(b * hkv):
        n = int(kept_cpu.view(-1)[s])
        scores = torch.rand(n, device="cuda", generator=gen)
        keep.append(torch.nonzero(scores < 0.5).flatten())  # about half of the kept slots
    moves = compaction_moves(keep, hkv)
    moved = moves.num_tokens
    d = k.shape[-1]
    payload = 2 * moved * 2 * d * 2  # K and V, read + write, bf16
    dst_cache = torch.empty_like(c["cache"])
    from lmcompact.layout.paged import vllm_kv_views

    dk, dv = vllm_kv_views(dst_cache)
    to_pool_ms = bench(lambda: cc.move_slots(k, v, table, dk, dv, table, moves))
    in_place_ms = bench(lambda: cc.move_slots(k, v, table, k, v, table, moves))
    result: dict[str, Any] = {
        "compaction": {
            "moved_tokens": moved,
            "payload_bytes": payload,
            "to_pool_ms": to_pool_ms,
            "to_pool_GBps": payload / to_pool_ms / 1e6,
            "bw_fraction": payload / to_pool_ms / 1e6 / copy_gbps,
            "in_place_staged_ms": in_place_ms,
            "in_place_effective_GBps": payload / in_place_ms / 1e6,
        }
    }
    c = decode_case(
        args.decode_batch,
        args.decode_prefix,
        ragged=True,
        seed=4,
        kept_range=(0.1, 0.5),
        hold_hole=True,
    )
    k, v, table, lengths = c["k"], c["v"], c["table"], c["lengths"]
    start = time.perf_counter()
    plan = plan_defragment(table, lengths, k.shape[1])
    plan_s = time.perf_counter() - start
    width = max(table.shape[1], plan.block_table.shape[1])
    old = torch.zeros(b, width, dtype=table.dtype, device="cuda")
    new = torch.zeros_like(old)
    old[:, : table.shape[1]] = table
    new[:, : plan.block_table.shape[1]] = plan.block_table.to(table.dtype)
    defrag_ms = bench(lambda: cc.move_slots(k, v, old, k, v, new, plan.moves))
    dpayload = 2 * plan.moves.num_tokens * 2 * d * 2
    result["defragment"] = {
        "requests": b,
        "kept_fraction_per_head": "uniform in [0.1, 0.5] of the prefix",
        "pool_blocks": int(c["cache"].shape[0]),
        "blocks_before": plan.blocks_before,
        "blocks_after": plan.blocks_after,
        "blocks_freed": plan.blocks_before - plan.blocks_after,
        "moved_tokens": plan.moves.num_tokens,
        "plan_host_s": plan_s,
        "move_ms": defrag_ms,
        "move_effective_GBps": dpayload / defrag_ms / 1e6,
    }
    return result
