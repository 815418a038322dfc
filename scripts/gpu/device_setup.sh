#!/bin/bash
# Device machine (nvidia-h200), from the repository root, in the call that carries
# .vcarry/p2 + .vcarry/tools + .vcarry/py (after a first call that carried .vcarry/p1 and ran
# `bash .vcarry/tools/stash.sh`): installs vLLM 0.26 into /tmp/site and keeps the pure-Python
# extras (xxhash for cp312) in /tmp/lmc-py, so later calls need carry nothing.
# Then source scripts/gpu/device_env.sh in every call.
set -euo pipefail
bash .vcarry/tools/stash.sh
bash .vcarry/tools/install.sh > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
rm -rf /tmp/lmc-py && cp -r .vcarry/py /tmp/lmc-py
echo "vLLM installed into /tmp/site; extras in /tmp/lmc-py"
