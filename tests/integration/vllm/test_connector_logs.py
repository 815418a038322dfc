"""The connector's INFO lines reach the engine's log, in-process and multiprocess.

vLLM configures only its own ``vllm`` logger tree; the connector hands its package loggers
vLLM's handlers when it is constructed
(:func:`connectors.vllm.patches.engine.share_engine_logging`).
Each case runs a real engine in a subprocess, as a user would, and reads its output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import sys
from vllm import SamplingParams

from connectors.vllm.offline import build_llm

if __name__ == "__main__":
    extra = {"policy": "snapkv", "budget": 0.5,
             "store": {"chunk_size": 256, "async_save": False},
             "release": {"prefill": "pack"}}
    llm = build_llm(sys.argv[1], extra, connector="LMCompactConnector", max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1600))}  # 600 tokens: 18 blocks + 24
    for _ in range(2):
        llm.generate([prompt], params, use_tqdm=False)
"""


@pytest.mark.parametrize("multiprocessing", ["0", "1"])
def test_connector_lines_in_engine_log(
    smollm2_path: Path, tmp_path: Path, multiprocessing: str
) -> None:
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(REPO),
        VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing,
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
    )
    env.pop("VLLM_LOGGING_LEVEL", None)
    done = subprocess.run(
        [sys.executable, str(script), str(smollm2_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    expected = [
        r"INFO .*\[connector\.py:\d+\] LMCompactConnector .*policy=snapkv "
        r"budget=0\.5 chunk=256 tiers=\['cpu'\]",
        r"INFO .*LMCompactConnector worker: 30 layers, .*policy snapkv, kept 128/256",
        r"INFO .*LMCompactConnector .* release: prefill=pack",
        # one line per compacted request: 18 full blocks packed to 9, 2 chunks stored
        r"INFO .*compacted \S+ in place in [0-9.]+ s \(scores [0-9.]+ s, plans [0-9.]+ s "
        r"over 1 asks\): kept 288 of 576 prompt tokens",
        r"INFO .*stored \S+: 2/2 chunks, kept 256 of 512 tokens",
    ]
    if multiprocessing == "0":  # the CPU tier is shared only inside one process
        expected.append(r"INFO .*loading \S+ from the store: 512 prefix tokens as 256 kept")
    missing = [pattern for pattern in expected if not re.search(pattern, log)]
    assert not missing, f"missing {missing} in:\n{log[-4000:]}"
