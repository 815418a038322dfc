"""What kvzip's context scores cost next to the prefill that produced the queries (CPU).

    python scripts/bench_kvzip_scores.py --contexts 2048,4096 --json /tmp/kvzip_cost.json

Times one SmolLM2 prefill (transformers, SDPA, float32) per context length, then
:func:`lmcompact.attention.scores.context_scores` over every layer with the same shapes
(``Hq`` = 9, ``Hkv`` = 3, ``D`` = 64, 30 layers) for kvzip's default sample (1024
queries), in its two modes: ``repeat`` (queries moved after the context, every key) and
``causal``. Both run in this process, one after the other, so the ratio is fair even on
a shared machine; the absolute seconds are not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lmcompact.attention.rope import Rope
from lmcompact.attention.scores import context_scores
from lmcompact.policies import make_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="2048,4096")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from lmcompact.hf.prepare import prepare_model

    torch.set_num_threads(1)
    path = prepare_model("smollm2")
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers, hq = config.num_hidden_layers, config.num_attention_heads
    hkv, d = config.num_key_value_heads, config.head_dim
    rope = Rope.from_theta(100_000.0, d)
    rows = []
    for t in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(100, 40_000, (1, t), generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            began = time.perf_counter()
            model(ids)
            prefill = time.perf_counter() - began
        policy = make_policy("kvzip")
        positions = policy.context_queries(t)
        gen = torch.Generator().manual_seed(0)
        row = {"context": t, "queries": int(positions.numel()), "prefill_s": prefill}
        for mode, shift in (("repeat", t), ("causal", None)):
            began = time.perf_counter()
            for _ in range(layers):
                q = torch.randn(1, hq, positions.numel(), d, generator=gen)
                k = torch.randn(1, hkv, t, d, generator=gen)
                context_scores(q, k, positions, shift=shift, rope=rope if shift else None)
            row[f"{mode}_s"] = time.perf_counter() - began
            row[f"{mode}_vs_prefill"] = row[f"{mode}_s"] / prefill
        rows.append(row)
        print(
            f"T={t}: prefill {prefill:.2f}s, scores repeat {row['repeat_s']:.2f}s "
            f"({row['repeat_vs_prefill']:.2f}x), causal {row['causal_s']:.2f}s "
            f"({row['causal_vs_prefill']:.2f}x), {row['queries']} queries",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
