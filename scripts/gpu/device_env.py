"""Shared start of the GPU check scripts in this folder (imported before vLLM or torch).

Sets the in-process vLLM environment the device machine needs, puts the repository root on
``sys.path`` (and ``.vcarry/py`` when the machine lacks the store's ``msgpack`` or ``xxhash``:
the pure-Python msgpack and the cp312 xxhash wheel unpacked there), and records the software
a result came from. A script may set any of these variables itself before importing this
module; ``setdefault`` keeps its value.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
try:
    import msgpack  # noqa: F401  (the store's codec needs both; the GPU machine may lack them)
    import xxhash  # noqa: F401
except ImportError:  # copies carried in .vcarry/py (git-ignored)
    sys.path.append(str(ROOT / ".vcarry" / "py"))

import torch  # noqa: E402


def on_cuda() -> bool:
    return torch.cuda.is_available()


def block_size() -> int:
    """KV block size of the checks: 16 under vLLM 0.26 on CUDA, 32 on the CPU build."""
    return 16 if on_cuda() else 32


def environment() -> dict[str, Any]:
    """Python, torch, vLLM and GPU of this run."""
    from connectors.vllm_shim import vllm_version

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm_version(),
        "cuda": on_cuda(),
    }
    if on_cuda():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env
