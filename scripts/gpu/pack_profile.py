"""Time the memory connector's in-place pack of one long prompt on the GPU, outside vLLM.

Pages are laid out as vLLM 0.26's FlashAttention cache (memory order block -> token -> head
-> K|V) for a Llama-3-8B shape: 32 layers, 8 KV heads, head_dim 128, bf16, block 32. Prints
the wall time per pack and the torch profiler's top operations, and writes them as JSON::

    PYTHONPATH=$PWD python3 scripts/gpu/pack_profile.py --tokens 16384 --json $OUT/pack.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from connectors.kv_layout import make_layout
from connectors.memory.packing import WindowQueries, pack_in_place
from lmcompact.policies.registry import make_policy


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--policy", default="snapkv")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    layers_n, heads, group, dim, block, window = 32, 8, 4, 128, 32, 32
    blocks = args.tokens // block
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [
        torch.randn(blocks + 1, block, heads, 2 * dim, device="cuda", generator=gen)
        .to(torch.bfloat16)
        .permute(0, 2, 1, 3)
        for _ in range(layers_n)
    ]
    row = list(range(1, blocks + 1))
    queries = [torch.randn(window, heads * group, dim).float() for _ in range(layers_n)]
    win = WindowQueries(
        per_layer=queries,
        positions=torch.arange(args.tokens - window, args.tokens),
        scale=dim**-0.5,
    )
    policy = make_policy(args.policy)
    kept = int(args.tokens * args.budget) // block * block
    layout = make_layout("token_major", block)
    times = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        pack_in_place(layers, layout, row, args.tokens, kept, policy, win)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        pack_in_place(layers, layout, row, args.tokens, kept, policy, win)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    cuda_table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
    print(f"pack of {args.tokens} tokens ({args.policy} {args.budget}): {times} s")
    print(table)
    print(cuda_table)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {
                    "tokens": args.tokens,
                    "policy": args.policy,
                    "pack_s": times,
                    "cpu_table": table,
                    "cuda_table": cuda_table,
                },
                handle,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
