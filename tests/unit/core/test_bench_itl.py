"""``lmcompact bench itl``: tail gaps matched to the engine steps that overlap them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from lmcompact.bench import itl


def _steps(durations_ms: list[float], kinds: list[str]) -> list[dict[str, object]]:
    steps, t = [], 100.0
    for i, (d, kind) in enumerate(zip(durations_ms, kinds, strict=True)):
        steps.append(
            {
                "kind": "step",
                "step": i,
                "t": t,
                "prefill_rows": int("prefill" in kind),
                "prefill_tokens": 8192 * int("prefill" in kind),
                "decode_rows": 4,
                "loads": 0,
                "packs": int("pack" in kind),
            }
        )
        t += d / 1e3
    return steps


def test_tail_gaps_get_the_cause_of_their_step_and_the_packs_share() -> None:
    # 200 decode steps of 10 ms, then a 250 ms prefill chunk that ends with a 6 ms pack,
    # then one 40 ms pack step, then decode steps again
    kinds = ["decode"] * 200 + ["prefill+pack", "pack"] + ["decode"] * 100 + ["decode"]
    durations = [10.0] * 200 + [250.0, 40.0] + [10.0] * 101
    steps = _steps(durations, kinds)
    packs = {200: [{"step": 200, "gpu_ms": 6.0}], 201: [{"step": 201, "gpu_ms": 30.0}]}
    # one request whose tokens arrive 1 ms after each step ends
    ends = [s["t"] + d / 1e3 + 0.001 for s, d in zip(steps, durations, strict=True)][:-1]
    result = {
        "start_times": [99.0],
        "ttfts": [ends[0] - 99.0],
        "itls": [[b - a for a, b in itertools.pairwise(ends)]],
    }
    got = itl.breakdown(result, steps, packs, q=99.0)
    assert got["decode_step_ms"] == pytest.approx(10.0)
    assert got["itl_count"] == len(ends) - 1
    # the slowest 1% of 301 gaps (4): the prefill step's, the pack step's, two decode ones
    assert got["tail_gaps"] == 4
    assert got["tail_causes"]["prefill chunk + pack"] == 1 and got["tail_causes"]["pack"] == 1
    assert got["connector_ms_in_tail_max"] == pytest.approx(30.0)
    assert got["connector_share_steps"] == pytest.approx(3.0)
    assert got["packs"] == 2 and got["pack_gpu_ms_max"] == 30.0


def test_trace_files_are_read_with_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    lines = [{"kind": "step", "step": i, "t": 10.0 - i} for i in range(3)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    Path(f"{path}.rank0").write_text(json.dumps({"step": 1, "gpu_ms": 2.0}) + "\n")
    Path(f"{path}.rank1").write_text(json.dumps({"step": 1, "gpu_ms": 3.0}) + "\n")
    steps, packs = itl.read_trace(path)
    assert [s["step"] for s in steps] == [2, 1, 0]  # time order
    assert [p["gpu_ms"] for p in packs[1]] == [2.0, 3.0]


def test_a_trace_without_decode_steps_is_refused() -> None:
    steps = _steps([100.0, 100.0], ["prefill", "prefill"])
    with pytest.raises(ValueError, match="no decode-only step"):
        itl.breakdown({"start_times": [], "ttfts": [], "itls": []}, steps, {})
