"""Compaction time, lmcompact vs kvpress, on the same captured prefill in one process.

Run with kvpress's venv (built by ``scripts/kvpress_env.sh``; lmcompact's core
policies, layout and scores need only torch)::

    PYTHONPATH=. ~/.cache/lmc-kvpress/bin/python scripts/bench_compaction_kvpress.py \\
        --context 2048 --budget 0.25 --threads 1 --json /tmp/compaction.json

One sdpa prefill of the harness's needle prompt is captured per layer (hidden
states, the attention kwargs, K/V, post-RoPE queries). Then, for every shared
policy and repeat, interleaved so machine load hits both alike:

- kvpress: ``press.compress(...)`` on every layer (scores + top-k + gather;
  SnapKV-style presses recompute their window queries from the hidden states).
- lmcompact: the scores the policy reads (``prompt_observations`` on the captured
  queries, as the attention forward does), ``policy.plan``, and
  ``ragged_from_dense`` per layer (the gather into ragged per-head K/V).

The minimum over repeats is reported, with the ratio lmcompact / kvpress.
h2o is left out: kvpress's ObservedAttentionPress needs the eager forward's
``(T x T)`` attention weights of every layer, which the eval measures instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lmcompact.compaction.policy_inputs import (
    compaction_inputs,
    layer_observation,
    prompt_observations,
)
from lmcompact.eval import tasks
from lmcompact.eval.kvpress_worker import make_press
from lmcompact.eval.policies import policy_for
from lmcompact.layout.ragged import ragged_from_dense

SHARED = ("streaming_llm", "snapkv", "pyramidkv", "adakv", "knorm", "tova", "random")
WINDOW = 32


def capture(model: Any, ids: list[int]) -> list[dict[str, Any]]:
    """Per layer: module, hidden states, kwargs, keys, values, post-RoPE queries."""
    from kvpress.presses.base_press import BasePress
    from kvpress.utils import get_prerope_query_states
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers: list[dict[str, Any]] = []

    class Capture(BasePress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):  # type: ignore[no-untyped-def]
            queries = get_prerope_query_states(module, hidden_states)
            cos, sin = kwargs["position_embeddings"]
            queries, _ = apply_rotary_pos_emb(queries, queries, cos, sin)
            layers.append(
                {
                    "module": module,
                    "hidden_states": hidden_states,
                    "kwargs": dict(kwargs),
                    "keys": keys,
                    "values": values,
                    "queries": queries,
                }
            )
            return keys, values

    with torch.no_grad(), Capture()(model):
        model(torch.tensor([ids]), past_key_values=DynamicCache(config=model.config))
    return layers


def time_kvpress(model: Any, press: Any, layers: list[dict[str, Any]]) -> float:
    press.post_init_from_model(model)
    start = time.perf_counter()
    for layer in layers:
        press.compress(
            layer["module"],
            layer["hidden_states"],
            layer["keys"],
            layer["values"],
            None,
            layer["kwargs"],
        )
    return time.perf_counter() - start


def time_lmcompact(policy: Any, layers: list[dict[str, Any]]) -> tuple[float, float]:
    """(scores seconds, plan + gather seconds) for one sequence."""
    scale = layers[0]["module"].scaling
    window = getattr(policy, "window_size", None) or WINDOW  # as CompactingCache picks it
    start = time.perf_counter()
    observations = [
        prompt_observations(
            policy.needs, layer["queries"], layer["keys"], window=window, scale=scale
        )[0]
        for layer in layers
    ]
    middle = time.perf_counter()
    inputs = compaction_inputs(
        policy.needs,
        [
            layer_observation(policy.needs, layer["keys"][0], layer["values"][0], observed=observed)
            for layer, observed in zip(layers, observations, strict=True)
        ],
        layers[0]["keys"].shape[2],
        layers[0]["keys"].shape[1],
    )
    plan = policy.plan(inputs)
    for index, layer in enumerate(layers):
        ragged_from_dense(layer["keys"], layer["values"], [plan.kept[index]])
    return middle - start, time.perf_counter() - middle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=str(Path.home() / ".cache/lmcompact/models/smollm2-135m-instruct")
    )
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--policies", default=",".join(SHARED))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tasks.build_needle_prompt(tokenizer, args.context, seed=0).input_ids
    layers = capture(model, ids)
    results = []
    for name in args.policies.split(","):
        policy = policy_for(name, args.budget, args.context)
        press = make_press(name, args.budget)
        ours: list[tuple[float, float]] = []
        theirs: list[float] = []
        with torch.no_grad():
            for _ in range(args.repeats):
                theirs.append(time_kvpress(model, press, layers))
                ours.append(time_lmcompact(policy, layers))
        best = min(ours, key=sum)
        row = {
            "policy": name,
            "press": type(press).__name__,
            "lmcompact_s": sum(best),
            "lmcompact_scores_s": best[0],
            "lmcompact_select_s": best[1],
            "kvpress_s": min(theirs),
            "ratio": sum(best) / min(theirs),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    payload = {
        "context": args.context,
        "budget": args.budget,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
