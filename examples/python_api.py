"""Compact KV and store it from Python, without vLLM or a server.

Computes K/V of a prompt with transformers, scores it with an observation window, keeps
half the tokens per head with SnapKV, and stores the compacted chunks in a CPU store keyed
by the token prefix, exactly as the vLLM connector does.

    PYTHONPATH=. python examples/python_api.py [MODEL_DIR]
"""

from __future__ import annotations

import os
import sys

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcompact.compaction.chunks import build_chunk
    from lmcompact.compaction.save_job import observe_layer
    from lmcompact.policies import CompactionInputs, LayerObservation, Need, make_policy
    from lmcompact.store import ChunkKeyer, StoreConfig, StoreNamespace, TieredStore

    model_dir = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.expanduser("~/.cache/lmcompact/models/smollm2-135m-instruct")
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    text = " ".join(f"Item {i} is stored on shelf {i * 7 % 31}." for i in range(60))
    ids = tokenizer(text, return_tensors="pt").input_ids
    chunk, window = 128, 32
    with torch.no_grad():
        out = model(ids, use_cache=True, output_hidden_states=False)
    past = out.past_key_values
    n = ids.shape[1] // chunk * chunk

    policy = make_policy("snapkv", budget=0.5)
    namespace = StoreNamespace(
        model_dir,
        "float32",
        "lmcompact-rows-v1",
        policy_name="snapkv",
        policy_params={"budget": 0.5},
    )
    store = TieredStore(namespace, StoreConfig(cpu_capacity_bytes=256 << 20))
    keys = ChunkKeyer(namespace, chunk).keys(ids[0].tolist())
    # Window queries are not exposed by transformers' forward; use the last keys as a stand-in
    # probe of the same shape (the connector captures the real queries inside attention).
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    per_layer = [(layer.keys[0], layer.values[0]) for layer in past.layers]
    stored = 0
    for c, key in enumerate(keys):
        lo, hi = c * chunk, (c + 1) * chunk
        layers = []
        for k, v in per_layer:
            probe = k[:, n - window : n].repeat_interleave(group, dim=0).transpose(0, 1)
            mass, _ = observe_layer(
                k[:, :n],
                v[:, :n],
                probe,
                torch.arange(n - window, n),
                0,
                Need.WINDOW_SCORES,
                k.shape[-1] ** -0.5,
            )
            assert mass is not None
            layers.append(
                LayerObservation(keys=k[:, lo:hi], values=v[:, lo:hi], window_scores=mass[:, lo:hi])
            )
        plan = policy.plan(
            CompactionInputs(chunk, layers[0].keys.shape[0], layers, budget_tokens=chunk // 2)
        )
        compacted = build_chunk(per_layer, lo, chunk, plan, chunk // 2, None)
        store.put(key, compacted)
        stored += compacted.payload_nbytes
    print(
        f"stored {len(keys)} chunks, {stored} bytes; lookup hits "
        f"{store.lookup_prefix(keys)} of {len(keys)}"
    )
    store.close()


if __name__ == "__main__":
    main()
