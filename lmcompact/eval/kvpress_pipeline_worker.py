"""Ask several questions against one context through kvpress's own pipeline (kvpress venv).

The counterpart of ``lmcompact eval --engine vllm`` (tasks ``multi_needle`` / ``needle``)
in NVIDIA kvpress: invoked by :func:`lmcompact.eval.kvpress_bridge.run_kvpress_stored` as
``<kvpress-venv>/bin/python kvpress_pipeline_worker.py JOB.json OUT.json``. Like
:mod:`lmcompact.eval.kvpress_worker` it imports only the standard library, torch,
transformers and kvpress (never lmcompact): it runs under kvpress's transformers.

Every case is run by ``KVPressTextGenerationPipeline._forward``, kvpress's own code path
behind ``pipeline(context=..., questions=[...], press=...)``, given the vLLM eval's token
ids instead of text (same contexts, same questions, no chat template):

``save`` (the question is not there when the context is compressed)
    ``context_ids`` = the context, ``questions_ids`` = every question: the pipeline
    prefills the context once under the press, then answers each question greedily from
    the compressed cache and drops the answer from the cache before the next one. The
    counterpart of our ``compact_on: save`` (a stored, query-agnostic prefix).
``load`` (the question is in the observation window)
    one pipeline call per question with ``context_ids`` = context + question minus its
    last token and ``questions_ids`` = that last token, so the press sees the question
    (SnapKV's window holds it; note kvpress may then drop question tokens too). The
    counterpart of our ``compact_on: load`` and ``inplace``.

Job: ``{"model": folder, "new_tokens": n, "threads": n | null, "presses": [{"policy",
"budget", "compact_on"}], "cases": [{"task", "context", "sample", "context_ids",
"question_ids": [[...], ...]}]}``; press ``{"policy": "none", "budget": 1.0,
"compact_on": "none"}`` is the full cache. Output: ``{"rows": [{"policy", "budget",
"compact_on", "task", "context", "sample", "question", "answer", "press", "seconds",
"kept_tokens"}], "refused": [{"policy", "budget", "compact_on", "error"}], "versions",
"done"}``, rewritten after every configuration (all its cases), so an interrupted run
keeps what finished (``done`` false); the bridge scores the answers. ``kept_tokens`` is
the cache length of layer 0 after the prefill (KVzipPress keeps every token and masks,
so there it equals the context).
"""

from __future__ import annotations

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


class KeptCounter:
    """Records the compressed cache length the pipeline leaves after its prefill."""

    def __init__(self) -> None:
        self.kept: list[int] = []

    def wrap(self, pipe: Any) -> None:
        original = pipe.generate_answer

        def generate_answer(question_ids: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
            self.kept.append(int(cache.get_seq_length()))
            return original(question_ids, cache, *args, **kwargs)

        pipe.generate_answer = generate_answer


@torch.no_grad()
def run_case(
    pipe: Any, counter: KeptCounter, press: Any, mode: str, case: dict[str, Any], new_tokens: int
) -> list[dict[str, Any]]:
    """One row per question of ``case``: the answer, its share of the time, the kept tokens."""
    context = case["context_ids"]
    questions = case["question_ids"]
    rows = []
    counter.kept.clear()
    if mode in ("save", "none"):
        start = time.perf_counter()
        answers = pipe._forward(
            {
                "context_ids": torch.tensor([context]),
                "questions_ids": [torch.tensor([q]) for q in questions],
            },
            max_new_tokens=new_tokens,
            press=press,
        )
        seconds = [(time.perf_counter() - start) / len(questions)] * len(questions)
    elif mode == "load":
        answers, seconds = [], []
        for q in questions:
            prompt = context + q
            start = time.perf_counter()
            answers += pipe._forward(
                {
                    "context_ids": torch.tensor([prompt[:-1]]),
                    "questions_ids": [torch.tensor([prompt[-1:]])],
                },
                max_new_tokens=new_tokens,
                press=press,
            )
            seconds.append(time.perf_counter() - start)
    else:
        raise ValueError(f"unknown compact_on {mode!r}; allowed: none, save, load")
    for index, answer in enumerate(answers):
        rows.append(
            {
                "task": case["task"],
                "context": case["context"],
                "sample": case["sample"],
                "question": index,
                "answer": answer,
                "seconds": seconds[index],
                "kept_tokens": counter.kept[index],
            }
        )
    return rows


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
    counter = KeptCounter()
    counter.wrap(pipe)
    versions = {
        "kvpress": getattr(kvpress, "__version__", None),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    output: dict[str, Any] = {"rows": [], "refused": [], "versions": versions, "done": False}
    for spec in job["presses"]:
        policy, budget, mode = spec["policy"], spec["budget"], spec["compact_on"]
        began = time.perf_counter()
        spec_rows: list[dict[str, Any]] = []
        for case in job["cases"]:
            try:
                press = make_press(policy, budget)
                case_rows = run_case(pipe, counter, press, mode, case, job["new_tokens"])
            except Exception as error:  # kvpress refusing a model is a result: report it
                output["refused"].append(
                    {**spec, "error": f"{type(error).__name__}: {error}"[:500]}
                )
                spec_rows = []
                break
            name = type(press).__name__ if press is not None else None
            spec_rows += [{**spec, "press": name, **r} for r in case_rows]
        output["rows"] += spec_rows
        write(out_path, output)  # every finished configuration survives an interruption
        print(
            f"kvpress {mode} {policy} b={budget}: {time.perf_counter() - began:.1f} s",
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
