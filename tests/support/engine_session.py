"""A vLLM CPU engine with the connector in its own process, driven by JSON lines on stdin.

Run by :class:`tests.support.engine_client.EngineClient` as
``python -m tests.support.engine_session --model M --extra JSON``. vLLM runs in its
multiprocess mode (``vllm serve``'s: the scheduler half of the connector lives in the
engine-core process, the worker half in a worker) or, with ``--in-process``, inside this
process; either way nothing is shared with other engines except the store's shared tier.
Requests, one JSON object per line:

    {"op": "generate", "prompt": [ids], "max_tokens": n}
        -> {"tokens": [ids], "cached": vLLM's num_cached_tokens, "finish": reason}
    {"op": "keys", "prompt": [ids]}
        -> {"keys": [the Redis keys of the prompt's full chunks, hex-decoded to str]}
    {"op": "quit"}

Each answer is one stdout line starting with :data:`MARK` (vLLM's own output is not).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

MARK = "@@engine "


def redis_keys(llm: Any, prompt: list[int]) -> list[str]:
    """Redis keys this engine stores ``prompt``'s full chunks under (rank 0, one rank)."""
    from connectors.vllm.spec import ConnectorSpec
    from lmcompact.store import ChunkKeyer

    spec = ConnectorSpec.build(llm.llm_engine.vllm_config)
    namespace = spec.namespaces[0]
    keyer = ChunkKeyer(namespace, spec.config.store.chunk_size)
    prefix = f"lmc:{namespace.digest().hex()}:"
    return [prefix + key.hex() for key in keyer.keys(prompt)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--extra", required=True, help="kv_connector_extra_config JSON")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--in-process", action="store_true", help="scheduler and worker in this one process"
    )
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.in_process else "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import SamplingParams

    from connectors.vllm.offline import build_llm

    llm = build_llm(args.model, json.loads(args.extra), max_model_len=args.max_model_len)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        if request["op"] == "keys":
            answer: dict[str, Any] = {"keys": redis_keys(llm, request["prompt"])}
        else:
            params = SamplingParams(
                temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=True
            )
            out = llm.generate([{"prompt_token_ids": request["prompt"]}], params, use_tqdm=False)
            answer = {
                "tokens": list(out[0].outputs[0].token_ids),
                "cached": int(out[0].num_cached_tokens or 0),
                "finish": out[0].outputs[0].finish_reason,
            }
        print(MARK + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
