"""The device-resident pack's Triton kernels in Triton's CPU interpreter, against torch.

Started as a subprocess by ``test_pack_interpreter.py`` (the interpreter must be on before
Triton kernels are defined). Exits non-zero on a mismatch. Checks:

* ``gather_pages`` / ``scatter_kept`` against their torch references (fresh random pages,
  vLLM 0.26's token-major strides: memory order block -> token -> head -> K|V);
* a whole :class:`lmcompact.compaction.device_pack.DevicePacker` pack against the reference
  pack (:func:`lmcompact.compaction.pack.pack_in_place`) on the same pages, per policy;
* the same on fp8 pages (uint8 bytes of float8 numbers, per-layer key scales).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from lmcompact.compaction.device_pack import DevicePacker
from lmcompact.compaction.kv_quant import Fp8Pages
from lmcompact.compaction.pack import WindowQueries, pack_in_place
from lmcompact.compaction.page_layout import make_layout
from lmcompact.kernels.paged_pack import (
    gather_pages,
    gather_pages_reference,
    layer_pointers,
    scatter_kept,
    scatter_kept_reference,
)
from lmcompact.policies.registry import make_policy

FAILURES: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        FAILURES.append(name)


def paged_layers(
    layers: int, blocks: int, heads: int, bs: int, dim: int, dtype: torch.dtype, seed: int
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(blocks, bs, heads, 2 * dim, generator=gen).to(dtype).permute(0, 2, 1, 3)
        for _ in range(layers)
    ]


def check_kernels() -> None:
    for dtype, bs, dim in ((torch.float32, 4, 8), (torch.bfloat16, 8, 16)):
        layers = paged_layers(3, 12, 2, bs, dim, dtype, seed=bs)
        row = torch.tensor([5, 2, 9, 7, 1, 11], dtype=torch.int64)
        ptrs = layer_pointers(layers)
        got = gather_pages(layers, ptrs, row)
        want = gather_pages_reference(layers, row)
        report(f"gather_pages {dtype} bs={bs}", torch.equal(got, want))
        kept = 2 * bs
        gen = torch.Generator().manual_seed(1)
        index = torch.stack(
            [
                torch.stack(
                    [torch.randperm(6 * bs, generator=gen)[:kept].sort().values for _ in range(2)]
                )
                for _ in range(3)
            ]
        )
        ref = [kv.clone() for kv in layers]
        scatter_kept(layers, ptrs, row, got, index)
        scatter_kept_reference(ref, row, want, index)
        same = all(torch.equal(a, b) for a, b in zip(layers, ref, strict=True))
        report(f"scatter_kept {dtype} bs={bs}", same)


def check_packer() -> None:
    layers_n, heads, group, dim, bs, window, tokens = 2, 2, 2, 16, 8, 8, 96
    blocks = tokens // bs + 3
    row = list(range(2, 2 + tokens // bs))
    layout = make_layout("token_major", bs)
    gen = torch.Generator().manual_seed(7)
    queries = [torch.randn(window, heads * group, dim, generator=gen) for _ in range(layers_n)]
    positions = torch.arange(tokens - window, tokens)
    win = WindowQueries(per_layer=queries, positions=positions, scale=dim**-0.5)
    for name in ("snapkv", "streaming_llm", "knorm"):
        kv = paged_layers(layers_n, blocks, heads, bs, dim, torch.float32, seed=3)
        ref = [k.clone() for k in kv]
        kept = 3 * bs
        policy = make_policy(name)
        chosen = pack_in_place(ref, layout, row, tokens, kept, policy, win)
        packer = DevicePacker(kv, bs, dim**-0.5)
        stacked = torch.stack(queries).permute(0, 2, 1, 3)
        index = packer.pack(row, tokens, kept, policy, stacked, positions)
        want = torch.stack([torch.stack(heads_) for heads_ in chosen])
        agree = float((index == want).float().mean())
        report(f"DevicePacker {name} indices", agree == 1.0, f"agreement {agree:.3f}")
        same = all(torch.equal(a, b) for a, b in zip(kv, ref, strict=True))
        report(f"DevicePacker {name} pages", same)


def check_fp8_packer() -> None:
    """fp8 caches (uint8 pages of float8 bytes, per-layer scales): the device pack scores
    the decoded keys and moves the bytes, as the reference pack does."""
    layers_n, heads, group, dim, bs, window, tokens = 2, 2, 2, 16, 8, 8, 96
    blocks = tokens // bs + 3
    row = list(range(2, 2 + tokens // bs))
    layout = make_layout("token_major", bs)
    pages = Fp8Pages.of("fp8", [0.5, 2.0], [1.0, 1.0])
    gen = torch.Generator().manual_seed(8)
    queries = [torch.randn(window, heads * group, dim, generator=gen) for _ in range(layers_n)]
    positions = torch.arange(tokens - window, tokens)
    win = WindowQueries(per_layer=queries, positions=positions, scale=dim**-0.5)
    for name in ("snapkv", "knorm"):
        floats = paged_layers(layers_n, blocks, heads, bs, dim, torch.float32, seed=4)
        kv = [k.to(torch.float8_e4m3fn).view(torch.uint8) for k in floats]
        ref = [k.clone() for k in kv]
        kept = 3 * bs
        policy = make_policy(name)
        chosen = pack_in_place(ref, layout, row, tokens, kept, policy, win, fp8=pages)
        packer = DevicePacker(kv, bs, dim**-0.5, fp8=pages, score_dtype=torch.float32)
        stacked = torch.stack(queries).permute(0, 2, 1, 3)
        index = packer.pack(row, tokens, kept, policy, stacked, positions)
        want = torch.stack([torch.stack(heads_) for heads_ in chosen])
        agree = float((index == want).float().mean())
        report(f"DevicePacker fp8 {name} indices", agree == 1.0, f"agreement {agree:.3f}")
        same = all(torch.equal(a, b) for a, b in zip(kv, ref, strict=True))
        report(f"DevicePacker fp8 {name} pages", same)


def main() -> int:
    check_kernels()
    check_packer()
    check_fp8_packer()
    if FAILURES:
        print("failed:", FAILURES)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
