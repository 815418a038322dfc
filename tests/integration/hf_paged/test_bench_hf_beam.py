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


def test_sequence_logprob_is_beam_search_score(folder: Path) -> None:
    """The float32 reference score of a beam is what beam search itself maximized."""
    import torch

    from lmcompact.bench.hf_beam_score import sequence_logprob

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(folder)
    ).eval()
    ids = torch.randint(0, 512, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = model.generate(
            ids,
            num_beams=4,
            do_sample=False,
            max_new_tokens=8,
            min_new_tokens=8,
            length_penalty=0.0,  # the score is the plain sum of log-probs
            early_stopping=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, 50:].tolist()
    assert sequence_logprob(model, ids, tokens) == pytest.approx(
        float(out.sequences_scores[0]), abs=1e-4
    )
    # any other continuation scores differently (the check can fail)
    other = [*tokens[:-1], (tokens[-1] + 1) % 512]
    assert sequence_logprob(model, ids, other) != pytest.approx(
        float(out.sequences_scores[0]), abs=1e-4
    )


def test_bench_bfloat16_judged_against_float32(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "beam.json"
    configs = "paged,dynamic_math,dynamic,paged_int8"  # dynamic runs first whatever the order
    assert hf_beam.run(_args(folder, out, "--configs", configs, "--dtype", "bfloat16")) == 0
    payload = json.loads(out.read_text())
    rows = {r["config"]: r for r in payload["results"]}
    assert payload["config"]["score_fp32"]
    assert rows["dynamic"]["fp32_logprob_gap"] == 0.0
    errors = {c: r["forced_logit_rel_err"] for c, r in rows.items()}
    # bf16 rounding is visible against float32, small, and int8 K/V adds to it
    assert all(0 < e < 0.05 for c, e in errors.items() if c != "paged_int8")
    assert errors["paged_int8"] > errors["paged"]
    diffs = {c: r["forced_rel_err_to_dynamic"] for c, r in rows.items()}
    assert diffs["dynamic"] == 0.0 and diffs["dynamic_math"] > 0 and diffs["paged"] > 0
    goal = payload["goals"]["paged forced diff<=dynamic_math's"]
    assert goal == (diffs["paged"] <= diffs["dynamic_math"])
    assert rows["paged"]["pool_back_to_start"] and rows["paged_int8"]["pool_back_to_start"]
    assert "dynamic_math" not in payload["beam_time_ratios"]


def test_forced_logits_paged_float32_equal_dynamic(folder: Path) -> None:
    """The teacher-forced decode (reorders with repeated parents) of PagedCache gives
    DynamicCache's logits in float32: the measure sees the cache, not only rounding."""
    import torch

    from lmcompact.bench.hf_beam_score import forced_logits, rel_err, reorders
    from lmcompact.hf.attention import enable_lmcompact_attention
    from lmcompact.hf.paged import PagedCache, blocks_needed

    assert bool((reorders(4, 9)[:, :-1] == reorders(4, 9)[:, 1:]).any())  # copy-on-write
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(folder)
    ).eval()
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 512, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    model.set_attn_implementation("sdpa")
    want = forced_logits(model, transformers.DynamicCache(config=model.config), ids, tokens, 4)
    enable_lmcompact_attention(model)
    blocks = blocks_needed(model.config, 4, 50, 16)
    cache = PagedCache(model.config, num_blocks=blocks, block_size=16)
    got = forced_logits(model, cache, ids, tokens, 4)
    assert got.shape == (10, 4, 512)
    assert rel_err(got, want) < 1e-5
    cache.check_accounting()
    # a cache that ignores the reorders is seen
    model.set_attn_implementation("sdpa")
    plain = transformers.DynamicCache(config=model.config)
    plain.reorder_cache = lambda beam_idx: None  # type: ignore[method-assign]
    assert rel_err(forced_logits(model, plain, ids, tokens, 4), want) > 1e-3
