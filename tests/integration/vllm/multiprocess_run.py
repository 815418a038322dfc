"""Three passes of one prompt through vLLM in multiprocess mode (as ``vllm serve`` runs).

Run by ``test_multiprocess.py`` as a script: the scheduler half lives in the engine-core
process and the worker half in a worker process, so the CPU tier is the worker's alone.
Prints one JSON line: per pass the greedy tokens and vLLM's ``num_cached_tokens``. With
``--pause`` it prints ``PAUSE`` after the second pass and waits for a line on stdin (the
test kills Redis there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--extra", required=True, help="kv_connector_extra_config JSON")
    parser.add_argument("--prompt", required=True, help="token ids, comma separated")
    parser.add_argument("--pause", action="store_true")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import SamplingParams

    from connectors.vllm.offline import build_llm

    llm = build_llm(
        args.model,
        json.loads(args.extra),
        connector="CheckedConnector",
        module_path="tests.integration.vllm.checked_connector",
        max_model_len=2048,
    )
    prompt = [int(t) for t in args.prompt.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    passes = []
    for index in range(3):
        if index == 2 and args.pause:
            print("PAUSE", flush=True)
            sys.stdin.readline()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        passes.append(
            {"tokens": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0)}
        )
    print(json.dumps({"passes": passes}), flush=True)


if __name__ == "__main__":
    main()
