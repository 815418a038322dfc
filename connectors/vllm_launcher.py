"""Old path of :mod:`lmcompact.vllm.vllm_launcher` (``python -m connectors.vllm_launcher``
keeps working for one release)."""

from __future__ import annotations

import sys

from lmcompact.vllm.vllm_launcher import main

if __name__ == "__main__":
    sys.exit(main())
