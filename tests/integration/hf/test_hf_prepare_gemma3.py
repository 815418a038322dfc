"""prepare_model("gemma3-270m"): four wheels joined, checked, converted, loadable offline."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lmcompact.hf.prepare import KNOWN_MODELS, prepare_model, read_marker

pytestmark = pytest.mark.integration


def test_marker_names_the_joined_gguf(gemma3_path: Path) -> None:
    marker = read_marker(gemma3_path)
    assert marker is not None
    spec = KNOWN_MODELS["gemma3-270m"]
    assert marker["source_sha256"] == spec.gguf_sha256
    assert marker["checks"]["config"] == spec.expect
    # 268.1M float32 parameters (tied embeddings stored once)
    assert 4 * 267_000_000 < (gemma3_path / "model.safetensors").stat().st_size < 4 * 269_000_000


def test_tokenizer_prepends_bos_and_layers_slide(gemma3_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gemma3_path))
    assert tokenizer("The capital of France is")["input_ids"][0] == tokenizer.bos_token_id
    config = AutoConfig.from_pretrained(str(gemma3_path))
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert list(config.layer_types).count("sliding_attention") == 15


def test_second_call_skips_the_download(gemma3_path: Path) -> None:
    start = time.perf_counter()
    assert prepare_model("gemma3-270m") == gemma3_path
    assert time.perf_counter() - start < 2.0  # the marker names the GGUF: nothing hashed
