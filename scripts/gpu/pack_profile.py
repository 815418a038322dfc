"""Time the release group's in-place pack of one long prompt on the GPU, outside vLLM.

Pages are laid out as vLLM 0.26's FlashAttention cache (memory order block -> token -> head
-> K|V) for a Llama-3-8B shape: 32 layers, 8 KV heads, head_dim 128, bf16, block 32. Times
the device-resident pack (:class:`lmcompact.compaction.device_pack.DevicePacker`) per prompt
length (host wall time with a synchronize, and CUDA-event device time), and the torch
reference pack once for comparison; prints the profiler's top CUDA operations of one
device pack and the bytes floor (the pack reads every K/V of the prompt once and writes
the kept ones)::

    PYTHONPATH=$PWD python3 scripts/gpu/pack_profile.py --tokens 16384,32768 --json $OUT/pack.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lmcompact.compaction.device_pack import DevicePacker
from lmcompact.compaction.pack import WindowQueries, pack_in_place
from lmcompact.compaction.page_layout import make_layout
from lmcompact.policies.registry import make_policy

LAYERS, HEADS, GROUP, DIM, BLOCK, WINDOW = 32, 8, 4, 128, 32, 32


def time_device(packer: DevicePacker, policy, tokens: int, kept: int, q, pos, repeats: int):
    row = list(range(1, tokens // BLOCK + 1))
    host, device = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        packer.pack(row, tokens, kept, policy, q, pos)
        end.record()
        launched = time.perf_counter() - began
        torch.cuda.synchronize()
        host.append(1e3 * launched)
        device.append(start.elapsed_time(end))
    return host, device


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="16384,32768")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--policy", default="snapkv")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--reference", action="store_true", help="also time the torch path")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    blocks = max(lengths) // BLOCK + 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [
        torch.randn(blocks, BLOCK, HEADS, 2 * DIM, device="cuda", generator=gen)
        .to(torch.bfloat16)
        .permute(0, 2, 1, 3)
        for _ in range(LAYERS)
    ]
    policy = make_policy(args.policy)
    packer = DevicePacker(layers, BLOCK, DIM**-0.5)
    results = []
    for tokens in lengths:
        kept = int(tokens * args.budget) // BLOCK * BLOCK
        q = torch.randn(LAYERS, HEADS * GROUP, WINDOW, DIM, device="cuda", generator=gen).to(
            torch.bfloat16
        )
        pos = torch.arange(tokens - WINDOW, tokens)
        first_host, first_device = time_device(packer, policy, tokens, kept, q, pos, 1)
        host, device = time_device(packer, policy, tokens, kept, q, pos, args.repeats)
        bytes_moved = LAYERS * HEADS * 2 * DIM * 2 * (tokens + 2 * kept)
        entry = {
            "tokens": tokens,
            "kept": kept,
            "first_ms": {"host": first_host[0], "device": first_device[0]},
            "device_ms_p50": statistics.median(device),
            "device_ms_max": max(device),
            "host_ms_p50": statistics.median(host),
            "floor_ms_at_4.3TBps": bytes_moved / 4.3e12 * 1e3,
        }
        if args.reference:
            layout = make_layout("token_major", BLOCK)
            win = WindowQueries([x.permute(1, 0, 2).float() for x in q], pos, DIM**-0.5)
            torch.cuda.synchronize()
            began = time.perf_counter()
            pack_in_place(
                layers, layout, list(range(1, tokens // BLOCK + 1)), tokens, kept, policy, win
            )
            torch.cuda.synchronize()
            entry["reference_ms"] = 1e3 * (time.perf_counter() - began)
        results.append(entry)
        print(json.dumps(entry))
    tokens = lengths[0]
    kept = int(tokens * args.budget) // BLOCK * BLOCK
    q = torch.randn(LAYERS, HEADS * GROUP, WINDOW, DIM, device="cuda").to(torch.bfloat16)
    pos = torch.arange(tokens - WINDOW, tokens)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        time_device(packer, policy, tokens, kept, q, pos, 1)
    cuda_table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14)
    print(cuda_table)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {
                    "policy": args.policy,
                    "budget": args.budget,
                    "results": results,
                    "cuda_table": cuda_table,
                },
                handle,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
