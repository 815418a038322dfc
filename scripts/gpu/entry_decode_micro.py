"""Device machine: where a per-head request's step goes, one layer at a time.

Times (CUDA graph of 32 launches, the 8B shape's layer count, replayed; ms per launch):
- torch's SDPA over a uniform request's 0.25 prefix + tail held contiguously (roughly what
  a one-count request pays per layer);
- the per-head launch (:func:`lmcompact.kernels.entry_attention.attend_entries`) over the
  same total cells laid out uniformly and ragged (largest head 3x the mean, as kvzip's
  ``per_head.slack`` 3 allows), at several key-split counts, each head's keys split or
  all heads' end to end (``balanced``, :mod:`lmcompact.kernels.entry_balanced`);
- the same for the step that prefills the prompt's last 256 tokens after a load.

    python scripts/gpu/entry_decode_micro.py --json $OUT/entry-decode-micro.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from lmcompact.kernels.entry_attention import EntryLengths, attend_entries, entry_splits
from lmcompact.kernels.synthetic import densify, random_paged_case

HKV, GROUP, D, BS, LAYERS = 8, 4, 128, 16, 32
PREFIX, TAIL, BASE, PREFILL = 16384, 64, 64, 256
KEPT = PREFIX // 4
SHAPES = {
    "uniform": [KEPT] * HKV,
    "ragged_3x": [
        3 * KEPT,
        3 * KEPT // 2,
        KEPT,
        KEPT // 2,
        KEPT // 2,
        KEPT // 2,
        KEPT // 2,
        KEPT // 2,
    ],
}


def graph_ms(launch: Callable[[], None], repeats: int = 50) -> float:
    """Mean ms of one ``launch`` replayed from a graph of ``LAYERS`` launches."""
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            launch()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (repeats * LAYERS)


def dense_ms(keys: int, q_len: int = 1) -> float:
    """torch's SDPA over ``keys`` contiguous keys per head (the last ``q_len`` queries,
    causal): what a layer of a request holding its kept keys uniformly costs, roughly."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q = rand(1, HKV * GROUP, q_len, D)
    k, v = rand(1, HKV, keys, D), rand(1, HKV, keys, D)
    mask = None
    if q_len > 1:  # query i sees keys up to keys - q_len + i
        rows = torch.arange(q_len, device="cuda")[:, None] + keys - q_len
        mask = torch.arange(keys, device="cuda")[None, :] <= rows

    def launch() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return graph_ms(launch)


def entry_ms(kept: list[int], splits: int, q_len: int = 1, balanced: bool = False) -> float:
    case = random_paged_case(
        [kept],
        [PREFIX],
        [max(TAIL, q_len)],
        [q_len],
        group=GROUP,
        head_dim=D,
        block_size=BS,
        dtype=torch.bfloat16,
        device="cuda",
        poison=False,
    )
    dense = densify(case, BASE, shrink=True)
    queries, key_pool, value_pool, table, cu_q, lengths = dense.attention_args()
    assert lengths.dense_start is not None and lengths.dense_base is not None
    entries = torch.full((key_pool.shape[0],), -1, dtype=torch.int32, device="cuda")
    entries[int(table[0, 0])] = 0
    tables = EntryLengths(
        entries,
        lengths.kept.to(torch.int32),
        lengths.dense_start.to(torch.int32),
        lengths.tail_start.to(torch.int32),
        lengths.dense_base.to(torch.int32),
    )
    out = torch.empty_like(queries)

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
            scale=D**-0.5,
            num_reqs=1,
            max_q_len=q_len,
            num_splits=splits,
            balanced=balanced,
        )

    return graph_ms(launch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows: dict[str, float] = {
        "sdpa_uniform_prefix": dense_ms(KEPT + TAIL),
    }
    default = entry_splits(1, 1, HKV, HKV * GROUP, D, 1, 3 * KEPT + TAIL, device)
    rows["default_splits"] = default
    for name, kept in SHAPES.items():
        for splits in sorted({4, 8, 16, 32, 64, default}):
            rows[f"entry_{name}_s{splits}"] = entry_ms(kept, splits)
            rows[f"entry_{name}_s{splits}_balanced"] = entry_ms(kept, splits, balanced=True)
    # the first step after a per-head load: the prompt's last 256 tokens, prefilled
    rows["sdpa_uniform_prefill256"] = dense_ms(KEPT + PREFILL, PREFILL)
    for name, kept in SHAPES.items():
        for splits in (1, 4, 8, 16):
            rows[f"entry_{name}_prefill256_s{splits}"] = entry_ms(kept, splits, PREFILL)
            rows[f"entry_{name}_prefill256_s{splits}_balanced"] = entry_ms(
                kept, splits, PREFILL, balanced=True
            )
    print(json.dumps(rows, indent=1))
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "ms_per_launch": rows}, f, indent=1)


if __name__ == "__main__":
    main()
