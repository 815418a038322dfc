"""``lmcompact bench hf-beam`` end to end on the CPU (small random-weight Llama, real generate)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from lmcompact.bench import hf_beam  # noqa: E402


def _args(folder: Path, out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    hf_beam.add_arguments(parser)
    common = ["--model", str(folder), "--random-weights", "--prompt-lengths", "200"]
    sizes = ["--new-tokens", "10", "--block-size", "16", "--json", str(out), "--plot", ""]
    return parser.parse_args([*common, *sizes, *extra])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=0.1,
    ).save_pretrained(path)
    return path


def test_bench_float32_same_tokens_exact_blocks(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "beam.json"
    configs = "dynamic,paged,paged_eager,paged_int8,paged_int8_compact"
    assert hf_beam.run(_args(folder, out, "--configs", configs, "--profile", "2")) == 0
    payload = json.loads(out.read_text())
    rows = {r["config"]: r for r in payload["results"]}
    assert payload["config"]["dtype"] == "float32" and not payload["config"]["cuda_graphs"]
    for name in ("paged", "paged_eager", "paged_int8"):
        assert rows[name]["pool_back_to_start"]
        assert rows[name]["profile"]["steps"] == 2
    assert rows["paged"]["same_tokens_as_dynamic"] and rows["paged_eager"]["same_tokens_as_dynamic"]
    assert rows["paged"]["common_prefix_tokens"] == 10
    # 4 beams share the 200-token prompt: 13 blocks + 4 x 1 tail block per layer, not 4 x 14
    memory = payload["beam_kv_memory_ratio"]
    assert memory["paged"] < 0.4 and memory["paged_int8"] < memory["paged"] * 0.3
    assert memory["paged_int8_compact"] < memory["paged_int8"]
    assert set(payload["goals"]) >= {"beam_time_ratio<=0.8", "paged_int8 memory<=0.15"}


def test_bench_bfloat16_keeps_bf16_kv(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "beam.json"
    assert hf_beam.run(_args(folder, out, "--configs", "dynamic,paged", "--dtype", "bfloat16")) == 0
    payload = json.loads(out.read_text())
    rows = {r["config"]: r for r in payload["results"]}
    assert payload["config"]["dtype"] == "bfloat16"
    # bf16 K/V: half the float32 bytes for the same blocks
    dynamic, paged = rows["dynamic"]["peak_kv_bytes"], rows["paged"]["peak_kv_bytes"]
    assert dynamic == 2 * 2 * 2 * 64 * 4 * (200 + 9) * 2  # layers x K,V x heads x D x beams x T
    assert paged % (16 * 2 * 64 * 2 * 2) == 0 and paged < 0.4 * dynamic
