"""``lmcompact bench connector`` without an engine: ``--configs`` checks, the row of vLLM
alone (``false``), ``cold_vs_warm`` and the prefill ratios (``offline`` faked)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from connectors.vllm import offline
from lmcompact.bench import connector as bench_connector


def bench_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_connector.add_arguments(parser)
    return parser.parse_args(["--json", str(tmp_path / "connector.json"), *extra])


@pytest.mark.parametrize("configs", ['[{"budget": 0.25}]', '{"a": true}', '{"a": 1}', "false"])
def test_configs_must_map_labels_to_objects_or_false(tmp_path: Path, configs: str) -> None:
    with pytest.raises(SystemExit, match="label -> object or false"):
        bench_connector.run(bench_args(tmp_path, "--configs", configs))


class FakeEngine:
    """``offline`` without vLLM: each request's seconds in order; the connector's counters
    fail for an engine built without it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: list[float]) -> None:
        self.seconds = list(seconds)
        self.extras: list[Any] = []
        self.requests: list[tuple[list[int], int]] = []
        monkeypatch.setattr(offline, "build_llm", self.build_llm)
        monkeypatch.setattr(offline, "generate", self.generate)
        monkeypatch.setattr(offline, "shutdown", lambda llm: None)
        monkeypatch.setattr(offline, "connector_stats", self.connector_stats)
        monkeypatch.setattr(offline, "request_counters", self.request_counters)

    def build_llm(self, model: str, extra: Any, **options: Any) -> str:
        self.extras.append(extra)
        return "llm"

    def generate(self, llm: Any, prompt: list[int], max_tokens: int) -> offline.Generation:
        self.requests.append((prompt, max_tokens))
        return offline.Generation([0], "", self.seconds.pop(0))

    def connector_stats(self) -> dict[str, Any]:
        assert self.extras[-1] is not None, "connector counters asked of vLLM alone"
        return {"loaded_chunks": len(self.requests), "bytes_stored": 1, "bytes_full": 4}

    def request_counters(self, llm: Any) -> dict[str, float]:
        assert self.extras[-1] is not None, "connector counters asked of vLLM alone"
        return {"blocks_released": 0}


def test_row_without_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine(monkeypatch, [3.0, 1.5])
    prompt = list(range(1, 65))
    row = bench_connector.measure("m", prompt, "vllm", 0.5, 32, config=False)
    assert engine.extras == [None]  # built without the connector
    assert [p for p, _ in engine.requests] == [bench_connector._other_prompt(prompt), prompt]
    assert row["connector"] is False and row["budget"] is None and row["policy"] == "vllm"
    assert (row["ttft_cold_s"], row["ttft_recompute_s"], row["cold_vs_warm"]) == (3.0, 1.5, 2.0)
    for key in ("ttft_hit_s", "speedup", "loaded_chunks", "stored_fraction"):
        assert row[key] is None
    assert row["blocks_held_fraction"] is None
    assert "decode_ms_recompute" not in row


def test_row_without_connector_decodes_a_fresh_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine(monkeypatch, [3.0, 1.0, 1.8])
    prompt = list(range(1, 65))
    row = bench_connector.measure("m", prompt, "vllm", 0.5, 32, decode_tokens=8, config=False)
    fresh, max_tokens = engine.requests[-1]
    assert fresh not in (prompt, bench_connector._other_prompt(prompt)) and max_tokens == 9
    assert row["decode_ms_recompute"] == pytest.approx(100.0)
    assert row["decode_ms_hit"] is None and row["decode_ratio"] is None


def test_connector_row_has_cold_vs_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    # cold, recompute, two hits, a second-step repeat
    engine = FakeEngine(monkeypatch, [4.0, 2.0, 0.5, 0.4, 0.6])
    row = bench_connector.measure("m", list(range(1, 65)), "snapkv", 0.25, 32)
    assert engine.extras[0]["policy"] == "snapkv"
    assert row["connector"] is True and row["budget"] == 0.25
    assert row["cold_vs_warm"] == 2.0 and row["ttft_hit_s"] == 0.4
    assert row["speedup"] == pytest.approx(5.0)


def test_prefill_ratios_skip_the_row_without_connector() -> None:
    rows: list[dict[str, Any]] = [
        {"policy": "vllm", "connector": False, "budget": None, "ttft_recompute_s": 1.0},
        {"policy": "none", "connector": True, "budget": 1.0, "ttft_recompute_s": 1.25},
        {"policy": "snapkv", "connector": True, "budget": 0.25, "ttft_recompute_s": 1.5},
    ]
    bench_connector._add_prefill_ratios(rows)
    assert [r["recompute_vs_exact"] for r in rows] == [0.8, 1.0, 1.2]
    alone = [{"policy": "vllm", "connector": False, "budget": None, "ttft_recompute_s": 1.0}]
    bench_connector._add_prefill_ratios(alone)
    assert "recompute_vs_exact" not in alone[0]


def test_run_accepts_false_and_prints_cold_vs_warm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, Any] = {}

    def measure(
        model: str, prompt: list[int], policy: str, *rest: Any, profile_cold: bool
    ) -> dict[str, Any]:
        assert profile_cold is False  # no --profile-cold
        seen[policy] = rest[-1]
        exact = policy == "none"
        return {
            "policy": policy,
            "connector": rest[-1] is not False,
            "budget": None if rest[-1] is False else 1.0 if exact else 0.25,
            "ttft_cold_s": 2.0,
            "ttft_recompute_s": 1.0 if rest[-1] is False else 2.0,
            "cold_vs_warm": 2.0,
        }

    monkeypatch.setattr(offline, "in_process_env", lambda kv_cache_gib: None)
    monkeypatch.setattr(bench_connector, "_text_prompt", lambda args: [1, 2, 3])
    monkeypatch.setattr(bench_connector, "measure", measure)
    configs = {"vllm": False, "none": {"policy": "none"}}
    assert bench_connector.run(bench_args(tmp_path, "--configs", json.dumps(configs))) == 0
    assert seen == configs
    assert "| cold_vs_warm |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "connector.json").read_text())["rows"]
    assert [r["recompute_vs_exact"] for r in rows] == [0.5, 1.0]


def test_profile_lists_cumulative_then_own_time_leaders() -> None:
    import cProfile
    import time

    def sleeper() -> None:
        time.sleep(0.05)  # the most own time

    def caller() -> None:  # the most cumulative time: the sleep and some work of its own
        sleeper()
        sum(range(200_000))

    profiler = cProfile.Profile()
    profiler.enable()
    caller()
    profiler.disable()
    names = [r["function"] for r in bench_connector._top_functions(profiler, "test", top=1)]
    assert len(names) == 2
    assert "caller" in names[0]
    assert "time.sleep" in names[1]
