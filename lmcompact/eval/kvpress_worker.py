"""Run NVIDIA kvpress presses on prompts given as token ids (inside kvpress's own venv).

Invoked by :mod:`lmcompact.eval.kvpress_bridge` as
``<kvpress-venv>/bin/python kvpress_worker.py JOB.json OUT.json``. This file
imports only the standard library, torch, transformers and kvpress (never
lmcompact), because it runs under transformers < 5.3, which kvpress 0.5.5 pins.

Job: ``{"model": folder, "new_tokens": n, "threads": n | null, "presses": [{"policy", "budget"}],
"samples": [{"context", "index", "needle_ids", "ppl_context", "ppl_continuation"}],
"tasks": [...]}``. Output: one row per (sample, press) with the greedy tokens,
the continuation NLL, the time spent inside ``press.compress`` and the bytes
the cache really holds afterwards.

Each press compresses the prompt during prefill only (kvpress's design); the
greedy decode and the perplexity continuation then run without hooks on the
compressed ``DynamicCache``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch


def make_press(policy: str, budget: float) -> Any:
    """The kvpress press matching an lmcompact policy, with the same hyper-parameters."""
    import kvpress

    ratio = 1.0 - budget
    if policy == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4)
    if policy == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)
    if policy == "pyramidkv":
        return kvpress.PyramidKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)
    if policy == "adakv":
        inner = kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)
        return kvpress.AdaKVPress(press=inner, alpha_safeguard=0.2)
    if policy == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if policy == "tova":
        return kvpress.TOVAPress(compression_ratio=ratio)
    if policy == "random":
        return kvpress.RandomPress(compression_ratio=ratio)
    if policy == "h2o":
        return kvpress.ObservedAttentionPress(compression_ratio=ratio)
    raise ValueError(f"no kvpress press for {policy!r}")


def needs_eager(policy: str) -> bool:
    return policy == "h2o"  # ObservedAttentionPress reads eager attention weights


def timed(press: Any) -> dict[str, float]:
    """Wrap ``press.compress`` to add its wall time to the returned dict."""
    spent = {"compress_s": 0.0}
    original = press.compress

    def compress(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent["compress_s"] += time.perf_counter() - start

    press.compress = compress
    return spent


def cache_facts(cache: Any, length: int) -> dict[str, Any]:
    kept = sum(layer.keys.shape[-2] * layer.keys.shape[1] for layer in cache.layers)
    slots = sum(layer.keys.shape[1] * length for layer in cache.layers)
    nbytes = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    return {"stored_ratio": kept / slots, "cache_bytes": nbytes}


@torch.no_grad()
def run_press(
    model: Any, press: Any, sample: dict[str, Any], job: dict[str, Any]
) -> dict[str, Any]:
    from transformers import DynamicCache

    out: dict[str, Any] = {}
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    if "needle" in job["tasks"] or "agreement" in job["tasks"]:
        spent = timed(press)
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([sample["needle_ids"]])
        start = time.perf_counter()
        with press(model):
            logits = model(ids, past_key_values=cache).logits[0, -1]
        facts = cache_facts(cache, ids.shape[1])
        tokens = [int(logits.argmax())]
        length = ids.shape[1]
        while len(tokens) < job["new_tokens"] and tokens[-1] not in eos_ids:
            # The compressed cache is shorter than the prompt: give the logical
            # position explicitly (transformers would derive it from the cache length).
            position = length + len(tokens) - 1
            step = model(
                torch.tensor([[tokens[-1]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[position]]),
                cache_position=torch.tensor([position]),
            ).logits[0, -1]
            tokens.append(int(step.argmax()))
        out.update(
            tokens=tokens,
            generate_s=time.perf_counter() - start,
            compaction_s=spent["compress_s"],
            **facts,
        )
    if "ppl" in job["tasks"]:
        spent = timed(press)
        cache = DynamicCache(config=model.config)
        context = torch.tensor([sample["ppl_context"]])
        continuation = sample["ppl_continuation"]
        start = time.perf_counter()
        with press(model):
            first = model(context, past_key_values=cache).logits[0, -1]
        # One token at a time with explicit positions: with a compressed cache the
        # mask transformers builds from cache_position would not be causal inside a
        # multi-token chunk (the cache is shorter than the logical length).
        steps = []
        for offset, token in enumerate(continuation[:-1]):
            position = context.shape[1] + offset
            steps.append(
                model(
                    torch.tensor([[token]]),
                    past_key_values=cache,
                    position_ids=torch.tensor([[position]]),
                    cache_position=torch.tensor([position]),
                ).logits[0, -1]
            )
        rest = torch.stack(steps) if steps else first.new_zeros(0, first.shape[-1])
        logits = torch.cat([first[None], rest]).float()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(continuation), reduction="sum")
        out.update(
            nll_sum=float(nll),
            count=len(continuation),
            forward_s=time.perf_counter() - start,
            ppl_compaction_s=spent["compress_s"],
        )
    return out


def main(job_path: str, out_path: str) -> int:
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM

    with open(job_path) as handle:
        job = json.load(handle)
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    total = len(job["samples"]) * len(job["presses"])
    done = 0
    for sample in job["samples"]:
        for spec in job["presses"]:
            policy, budget = spec["policy"], spec["budget"]
            try:
                press = make_press(policy, budget)
            except ValueError as error:
                skipped[policy] = str(error)
                continue
            model.set_attn_implementation("eager" if needs_eager(policy) else "sdpa")
            try:
                result = run_press(model, press, sample, job)
            except Exception as error:  # report, do not hide: the bridge lists these
                skipped[f"{policy}@{budget}"] = f"{type(error).__name__}: {error}"
                continue
            rows.append(
                {
                    "policy": policy,
                    "budget": budget,
                    "context": sample["context"],
                    "sample": sample["index"],
                    "press": type(press).__name__,
                    **result,
                }
            )
            done += 1
            print(
                f"kvpress {done}/{total} {policy} b={budget} ctx={sample['context']}",
                file=sys.stderr,
                flush=True,
            )
    versions = {
        "kvpress": getattr(kvpress, "__version__", None),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    with open(out_path, "w") as handle:
        json.dump({"rows": rows, "skipped": skipped, "versions": versions}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
