"""Bytes and codec speed of quantized stored chunks (int8, fp8) against bf16, on the CPU.

    PYTHONPATH=$PWD python scripts/store_quantization_bench.py \
        --json docs/benchmarks/store-quantization-cpu.json

One chunk of an 8B-shaped model (Llama-3-8B: 32 layers, 8 kv heads, head_dim 128; bf16),
256 tokens, every token kept (``--tokens`` / ``--layers`` / ``--kv-heads`` / ``--head-dim``
change it). Per format (``bf16``: the codec's raw values, ``int8``, ``fp8``), each round
times once, back to back:

* ``encode``: :meth:`ChunkCodec.encode` (raw: frame + xxh3-128 over the chunk in place;
  quantized: per-row scales, rows quantized into a new buffer, xxh3-128);
* ``decode``: :meth:`ChunkCodec.decode` of the value's bytes (as redis-py returns them):
  every check, xxh3-128, then views (raw) or rows dequantized into a new bf16 buffer;
* ``put``: :meth:`ChunkCodec.encode_served`, what a quantizing :class:`TieredStore` runs
  per put (encode plus the dequantized rows its memory tiers hold).

MB/s are of the chunk's bf16 payload (positions + keys + values, the same bytes for every
format), so the columns compare directly. Rounds alternate over the formats so load from
other processes spreads over all of them; the JSON keeps every round's times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lmcompact.store import ChunkCodec, CompactedChunk, StoreNamespace
from lmcompact.store.quant import QUANT_DTYPES

warnings.filterwarnings("ignore", message="The given buffer is not writable")


def make_chunk(tokens: int, layers: int, heads: int, dim: int, seed: int = 0) -> CompactedChunk:
    """Keys with per-channel outliers (as post-RoPE keys have), values near unit scale."""
    g = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(dim, generator=g))  # ~0.1x to ~10x per channel
    keys = torch.randn(layers, heads, tokens, dim, generator=g) * channel
    values = torch.randn(layers, heads, tokens, dim, generator=g)
    return CompactedChunk.from_dense(keys.bfloat16(), values.bfloat16()).clone()


def timed(fn: Any) -> tuple[float, Any]:
    began = time.perf_counter()
    out = fn()
    return time.perf_counter() - began, out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    chunk = make_chunk(args.tokens, args.layers, args.kv_heads, args.head_dim)
    payload = chunk.payload_nbytes
    formats = ["bf16"] + [m for m in ("int8", "fp8") if m in QUANT_DTYPES]
    codecs: dict[str, ChunkCodec] = {}
    for name in formats:
        ns = StoreNamespace(
            "bench-8b",
            "bfloat16",
            "bench",
            policy_params={"budget": 1.0} | ({} if name == "bf16" else {"quantize": name}),
        )
        codecs[name] = ChunkCodec(ns, quantize=None if name == "bf16" else name)
    values = {name: codecs[name].encode(chunk).tobytes() for name in formats}
    times: dict[str, dict[str, list[float]]] = {
        name: {"encode": [], "decode": [], "put": []} for name in formats
    }
    for _ in range(args.rounds):
        for name in formats:
            codec = codecs[name]
            t, _ = timed(lambda c=codec: c.encode(chunk))  # parts, not joined (as Redis writes)
            times[name]["encode"].append(t)
            t, _ = timed(lambda c=codec, v=values[name]: c.decode(v))
            times[name]["decode"].append(t)
            t, _ = timed(lambda c=codec: c.encode_served(chunk))
            times[name]["put"].append(t)
    rows = []
    for name in formats:
        back = codecs[name].decode(values[name])
        row: dict[str, Any] = {
            "format": name,
            "value_bytes": len(values[name]),
            "payload_bytes": _payload_len(values[name]),
            "value_ratio_vs_bf16": len(values[name]) / len(values["bf16"]),
            "payload_ratio_vs_bf16": _payload_len(values[name]) / payload,
            **_errors(chunk, back, name),
        }
        for step_name, samples in times[name].items():
            med, best = statistics.median(samples), min(samples)
            row[f"{step_name}_s_median"] = med
            row[f"{step_name}_s_best"] = best
            row[f"{step_name}_MBps_median"] = payload / med / 1e6
            row[f"{step_name}_MBps_best"] = payload / best / 1e6
        row["times_s"] = times[name]
        rows.append(row)
    return {
        "shape": {
            "tokens": args.tokens,
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": "bfloat16",
            "bf16_payload_bytes": payload,
        },
        "rounds": args.rounds,
        "torch_threads": args.threads,
        "torch": torch.__version__,
        "machine": {
            "processor": _cpu_name(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "python": platform.python_version(),
        },
        "rows": rows,
    }


def _errors(chunk: CompactedChunk, back: CompactedChunk, name: str) -> dict[str, float]:
    """Worst error of keys and values over the format's bound (<= 1: within it), and the
    relative RMS error. Bounds, with ``s`` the row's scale and one bf16 rounding of the
    dequantized value (``2^-8 |deq|``): int8 ``s / 2``, fp8 ``2^-4 |x|`` (``2^-10 s``
    where ``x / s`` is subnormal in e4m3)."""
    worst = num = den = 0.0
    for x, y in ((chunk.keys, back.keys), (chunk.values, back.values)):
        x, y = x.double(), y.double()
        err = (x - y).abs()
        num += float((err**2).sum())
        den += float((x**2).sum())
        if name == "bf16":
            continue
        qmax = 127.0 if name == "int8" else 448.0
        s = x.abs().amax(dim=1, keepdim=True) / qmax * (1 + 2**-10)  # float16, rounded up
        if name == "int8":
            bound = s / 2
        else:
            bound = torch.where(x.abs() >= s * 2**-6, x.abs() * 2**-4, s * 2**-10)
        bound = bound + y.abs() * 2**-8 + 1e-30
        worst = max(worst, float((err / bound).max()))
    return {"max_err_over_bound": worst, "rel_rms_err": (num / den) ** 0.5}


def _payload_len(value: bytes) -> int:
    """Bytes of a value after its frame head (magic, header, padding)."""
    hlen = int.from_bytes(value[4:8], "little")
    return len(value) - (8 + hlen + (-(8 + hlen) % 16))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def table(result: dict[str, Any]) -> str:
    lines = [
        "| format | value MiB | payload vs bf16 | rel. RMS error | encode MB/s | decode MB/s "
        "| put MB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['format']} | {r['value_bytes'] / 2**20:.2f} | {r['payload_ratio_vs_bf16']:.4f} "
            f"| {r['rel_rms_err']:.2e} "
            f"| {r['encode_MBps_median']:.0f} (best {r['encode_MBps_best']:.0f}) "
            f"| {r['decode_MBps_median']:.0f} (best {r['decode_MBps_best']:.0f}) "
            f"| {r['put_MBps_median']:.0f} (best {r['put_MBps_best']:.0f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    slim = {
        **result,
        "rows": [{k: v for k, v in r.items() if k != "times_s"} for r in result["rows"]],
    }
    print(json.dumps(slim, indent=2))
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
