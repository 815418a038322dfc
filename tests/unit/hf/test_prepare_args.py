"""prepare_model argument validation (no download, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcompact.hf.prepare import cache_root, prepare_model


def test_unknown_name_lists_allowed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smollm2"):
        prepare_model("no-such-model", cache_dir=tmp_path)


def test_folder_without_weights_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        prepare_model(tmp_path, cache_dir=tmp_path / "cache")


def test_cache_root_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMCOMPACT_CACHE", str(tmp_path))
    assert cache_root() == tmp_path / "models"
    monkeypatch.delenv("LMCOMPACT_CACHE")
    assert cache_root() == Path.home() / ".cache" / "lmcompact" / "models"


def test_importing_prepare_does_not_import_transformers() -> None:
    import subprocess
    import sys

    code = "import sys, lmcompact.hf.prepare; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
