"""Ask several questions against one context through kvpress's own pipeline (kvpress venv).

The counterpart of ``lmcompact eval --engine vllm`` (tasks ``multi_needle`` / ``needle``)
in NVIDIA kvpress: invoked by :func:`lmcompact.eval.kvpress_bridge.run_kvpress_stored` as
``<kvpress-venv>/bin/python kvpress_pipeline_worker.py JOB.json OUT.json``. Like
:mod:`lmcompact.eval.kvpress_worker` it imports only the standard library, torch,
transformers and kvpress (never lmcompact): it runs under kvpress's transformers.

Every case is answered with kvpress's own code: the presses' ``forward_hook`` /
``compress`` and the pipeline's ``generate_answer`` / ``_remove_answer_from_cache`` (the
loop behind ``pipeline(context=..., questions=[...], press=...)``), given the vLLM eval's
token ids instead of text (same contexts, same questions, no chat template):

``save`` (the question is not there when the context is compressed)
    the context is prefilled and compressed once, then every question is answered
    greedily from the compressed cache, the answer dropped before the next one. The
    counterpart of our ``compact_on: save`` (a stored, query-agnostic prefix).
``load`` (the question is in the observation window)
    per question, context + question minus its last token is compressed and that last
    token is the "question" of the pipeline, so the press sees the question (SnapKV's
    window holds it; kvpress may then drop question tokens too). The counterpart of our
    ``compact_on: load`` and ``inplace``.

A scorer press compresses in a hook after each attention layer, so the prefill itself
does not depend on it: one prefill per prompt serves every scorer press and budget
(:class:`Prefill`, which calls the press's own hook with the recorded arguments).
KVzipPress (its own reconstruction passes) goes through ``KVPressTextGenerationPipeline
._forward`` unchanged.

Job: ``{"model": folder, "new_tokens": n, "threads": n | null, "presses": [{"policy",
"budget", "compact_on"}], "cases": [{"task", "context", "sample", "context_ids",
"question_ids": [[...], ...]}]}``; press ``{"policy": "none", "budget": 1.0,
"compact_on": "none"}`` is the full cache. Output: ``{"rows": [{"policy", "budget",
"compact_on", "task", "context", "sample", "question", "answer", "press", "seconds",
"kept_tokens"}], "refused": [{"policy", "budget", "compact_on", "error"}], "versions",
"done"}``, rewritten after every case (all configurations), so an interrupted run keeps
what finished (``done`` false); the bridge scores the answers. ``kept_tokens`` is
the cache length of layer 0 after the prefill (KVzipPress keeps every token and masks,
so there it equals the context).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from typing import Any

import torch


def make_press(policy: str, budget: float) -> Any:
    """The kvpress press for an lmcompact policy (hyper-parameters as the vLLM eval's:
    window 32; kvpress's defaults otherwise); None for the full cache."""
    import kvpress

    ratio = 1.0 - budget
    if policy == "none":
        return None
    if policy == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)
    if policy == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4)
    if policy == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if policy == "kvzip":
        return kvpress.KVzipPress(compression_ratio=ratio)
    if policy == "expected_attention":
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio)
    raise ValueError(f"no kvpress press for {policy!r}")


class Prefill:
    """One plain prefill of ``ids`` ``(1, T)`` and what every attention layer's forward
    hook would have been given (kwargs and output), to run presses from it.

    kvpress compresses in a forward hook that runs after each attention layer: the
    layer's output already used the full keys, so the hidden states of the prefill do
    not depend on the press. :meth:`compressed` therefore calls the press's own
    ``forward_hook`` with the recorded arguments on a fresh copy of the full cache:
    what ``with press(model): model.model(ids, past_key_values=cache)`` computes, with
    one prefill shared by every press and budget.
    """

    def __init__(self, model: Any, ids: list[int]) -> None:
        from transformers import DynamicCache

        self.length = len(ids)
        self.calls: list[tuple[Any, dict[str, Any], Any]] = []
        layers = model.model.layers
        hooks = [
            layer.self_attn.register_forward_hook(self._record, with_kwargs=True)
            for layer in layers
        ]
        self.cache: Any = DynamicCache()
        try:
            model.model(input_ids=torch.tensor([ids]), past_key_values=self.cache)
        finally:
            for hook in hooks:
                hook.remove()

    def _record(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        kept = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}
        self.calls.append((module, kept, output))

    def compressed(self, model: Any, press: Any) -> Any:
        """A new ``DynamicCache`` holding the prefill compressed by ``press`` (None: full)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for index, layer in enumerate(self.cache.layers):
            cache.update(layer.keys, layer.values, index)
        if press is None:
            return cache
        with press(model):  # the press's own set-up (post_init_from_model, rotary_emb)
            for module, kwargs, output in self.calls:
                press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, output)
        return cache


def answer(
    pipe: Any, cache: Any, questions: list[list[int]], context_length: int, new_tokens: int
) -> list[str]:
    """kvpress's pipeline loop: every question from ``cache``, the answer dropped after it."""
    answers = []
    for question in questions:
        lengths = [cache.get_seq_length(i) for i in range(len(cache))]
        answers.append(
            pipe.generate_answer(
                question_ids=torch.tensor([question]),
                cache=cache,
                context_length=context_length,
                max_new_tokens=new_tokens,
            )
        )
        pipe._remove_answer_from_cache(cache, lengths)
    return answers


def recorded(spec: dict[str, Any]) -> bool:
    """Whether a configuration runs from a shared prefill (every scorer press; KVzipPress
    runs its own reconstruction passes through the pipeline, and ``"pipeline": true`` in
    a press asks for the pipeline too: the test that both give the same answers)."""
    return spec["policy"] != "kvzip" and not spec.get("pipeline", False)


@torch.no_grad()
def run_case(
    pipe: Any, specs: list[dict[str, Any]], case: dict[str, Any], new_tokens: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every configuration on one case: rows (one per question) and refusals."""
    model = pipe.model
    context, questions = case["context_ids"], case["question_ids"]
    rows: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    shared: dict[str, Prefill] = {}
    for spec in specs:
        mode = spec["compact_on"]
        try:
            press = make_press(spec["policy"], spec["budget"])
            if mode in ("none", "save"):
                prompts = [(context, questions)]
            elif mode == "load":  # the question minus its last token inside the window
                prompts = [((context + q)[:-1], [(context + q)[-1:]]) for q in questions]
            else:
                raise ValueError(f"unknown compact_on {mode!r}; allowed: none, save, load")
            answers, kept, seconds = [], [], []
            for ids, asked in prompts:
                start = time.perf_counter()
                if recorded(spec):
                    key = json.dumps(ids[-8:]) + str(len(ids))
                    if key not in shared:
                        shared[key] = Prefill(model, ids)
                    cache = shared[key].compressed(model, press)
                    kept.append(int(cache.get_seq_length()))
                    answers += answer(pipe, cache, asked, len(ids), new_tokens)
                else:
                    answers += pipe._forward(
                        {
                            "context_ids": torch.tensor([ids]),
                            "questions_ids": [torch.tensor([q]) for q in asked],
                        },
                        max_new_tokens=new_tokens,
                        press=press,
                    )
                    kept.append(len(ids))  # KVzipPress masks: the cache keeps every token
                seconds += [(time.perf_counter() - start) / len(asked)] * len(asked)
                kept += [kept[-1]] * (len(asked) - 1)
        except Exception as error:  # kvpress refusing a model is a result: report it
            refused.append({**spec, "error": f"{type(error).__name__}: {error}"[:500]})
            continue
        name = type(press).__name__ if press is not None else None
        for index, text in enumerate(answers):
            rows.append(
                {
                    **spec,
                    "press": name,
                    "task": case["task"],
                    "context": case["context"],
                    "sample": case["sample"],
                    "question": index,
                    "answer": text,
                    "seconds": seconds[index],
                    "kept_tokens": kept[index],
                }
            )
    return rows, refused


def main(job_path: str, out_path: str) -> int:
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(job_path) as handle:
        job = json.load(handle)
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device="cpu")
    versions = {
        "kvpress": importlib.metadata.version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    output: dict[str, Any] = {"rows": [], "refused": [], "versions": versions, "done": False}
    refused: dict[str, dict[str, Any]] = {}
    for case in job["cases"]:
        began = time.perf_counter()
        specs = [p for p in job["presses"] if json.dumps(p, sort_keys=True) not in refused]
        rows, failed = run_case(pipe, specs, case, job["new_tokens"])
        output["rows"] += rows
        for item in failed:  # a refused configuration is not tried on later cases
            spec = {k: item[k] for k in ("policy", "budget", "compact_on")}
            refused[json.dumps(spec, sort_keys=True)] = item
        output["refused"] = list(refused.values())
        write(out_path, output)  # every finished case survives an interruption
        print(
            f"kvpress {case['task']} sample {case['sample']} ctx={case['context']}: "
            f"{len(rows)} answers in {time.perf_counter() - began:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    output["done"] = True
    write(out_path, output)
    return 0


def write(path: str, output: dict[str, Any]) -> None:
    """Replace ``path`` with ``output`` (written beside it, then renamed)."""
    import os

    with open(path + ".tmp", "w") as handle:
        json.dump(output, handle)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
