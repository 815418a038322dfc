"""prepare_model on the real SmolLM2 wheel: idempotent, verified, loadable offline."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lmcompact.hf.prepare import KNOWN_MODELS, prepare_model, read_marker

pytestmark = pytest.mark.integration


def test_prepared_folder_has_marker_and_float32_weights(smollm2_path: Path) -> None:
    marker = read_marker(smollm2_path)
    assert marker is not None
    assert marker["dtype"] == "float32"
    assert marker["checks"]["config"] == KNOWN_MODELS["smollm2"].expect
    weights = smollm2_path / "model.safetensors"
    # 134.5M float32 parameters (tied embeddings stored once)
    assert 4 * 134_000_000 < weights.stat().st_size < 4 * 136_000_000


def test_second_call_is_a_cache_hit(smollm2_path: Path) -> None:
    before = (smollm2_path / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = prepare_model("smollm2")
    elapsed = time.perf_counter() - start
    assert again == smollm2_path
    assert (smollm2_path / "model.safetensors").stat().st_mtime_ns == before
    assert elapsed < 10.0  # hashing the 93 MB wheel, no conversion


def test_local_hf_folder_is_returned_as_is(smollm2_path: Path) -> None:
    assert prepare_model(str(smollm2_path)) == smollm2_path.resolve()
