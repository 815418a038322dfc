"""Teacher-force "generated" text through kvpress's ``DecodingPress`` (kvpress venv).

Invoked by :func:`lmcompact.eval.kvpress_bridge.run_kvpress_decoding` as
``<kvpress-venv>/bin/python kvpress_decoding_worker.py JOB.json OUT.json``. Like the other
kvpress workers it imports only the standard library, torch, transformers and kvpress
(never lmcompact): it runs under kvpress's transformers (< 5.3).

Per case (:func:`lmcompact.eval.recall_after_generation.build_cases`: a prompt hiding
facts, then other natural text fed as if generated, then one question per fact)::

    prompt (one prefill) | g_0 .. g_N-1 | q_0 .. q_Q-1 | 8 greedy answer tokens
                           ^ one token per forward, inside ``with press(model):``

kvpress's ``DecodingPress`` acts in a forward hook after every attention layer, only
when the forward is not the prefill (``cache_position[-1] + 1 != q_len``); it counts
forwards per layer and every ``compression_interval`` of them gives the layer's cache to
its ``base_press`` with the buffered hidden states of those forwards, to keep
``target_size`` tokens. So the prompt is prefilled whole (never compressed) and every
later token goes through its own forward, as kvpress's pipeline decodes. Positions go in
as ``position_ids`` (the pipeline's ``generate_answer`` does the same): after a
compression the cache is shorter than the sequence.

The prompt + generated part is the same for every question of a case: it runs once and
the cache and the press's per-layer state (``hidden_states_buffer``,
``layer_step_counts``) are copied for each question, which then continues exactly as a
run from scratch would.

Per forced token (the token the next forward is fed): the model's own top-1 and the
log-probability of the forced token, from the logits of the position before it.

Job: ``{"model": folder, "threads": n | null, "new_tokens": n, "interval": n,
"window_size": n, "kernel_size": n, "runs": [{"name", "target_size": n | null}],
"cases": [{"prompt_ids", "generated_ids", "question_ids": [[...], ...]}]}``; ``target_size``
null is the full cache (no press). Output: ``{"runs": [{"name", "target_size", "press",
"cases": [{"generated": {"top1", "logprob"}, "questions": [{"top1", "logprob", "answer_ids",
"cache_length"}], "seconds"}]}], "versions", "done"}``, rewritten after every case.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import json
import os
import sys
import time
from typing import Any

import torch


def make_press(job: dict[str, Any], target_size: int | None) -> Any:
    """``DecodingPress`` around kvpress's SnapKV (None: the full cache).

    SnapKV's scorer asserts more buffered hidden states than its window; the buffer
    holds the ``interval`` forwards since the last compression, so the window is at most
    ``interval - 1``."""
    import kvpress

    if target_size is None:
        return None
    window = min(int(job["window_size"]), int(job["interval"]) - 1)
    scorer = kvpress.SnapKVPress(window_size=window, kernel_size=int(job["kernel_size"]))
    return kvpress.DecodingPress(
        base_press=scorer,
        compression_interval=int(job["interval"]),
        target_size=int(target_size),
        hidden_states_buffer_size=int(job["interval"]),
    )


class Stepper:
    """Feeds tokens through ``model`` with ``cache``, tracking the absolute position."""

    def __init__(self, model: Any, cache: Any, position: int) -> None:
        self.model = model
        self.cache = cache
        self.position = position

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Forward ``ids`` at the next positions; ``(V,)`` log-probs of the last one."""
        positions = torch.arange(self.position, self.position + len(ids))[None]
        out = self.model(
            input_ids=torch.tensor([ids]),
            past_key_values=self.cache,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        self.position += len(ids)
        return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


def forced(stepper: Stepper, first: torch.Tensor, tokens: list[int]) -> dict[str, Any]:
    """Feed ``tokens`` one per forward; ``first`` predicts ``tokens[0]``. Returns the top-1
    and the forced token's log-prob per token, and the log-probs after the last one."""
    top1: list[int] = []
    logprob: list[float] = []
    current = first
    for token in tokens:
        top1.append(int(current.argmax()))
        logprob.append(float(current[token]))
        current = stepper.feed([token])
    return {"top1": top1, "logprob": logprob, "last": current}


def press_state(press: Any) -> Any:
    return (
        None
        if press is None
        else copy.deepcopy((press.hidden_states_buffer, press.layer_step_counts))
    )


def set_press_state(press: Any, state: Any) -> None:
    if press is not None:
        press.hidden_states_buffer, press.layer_step_counts = copy.deepcopy(state)


@torch.no_grad()
def run_case(model: Any, press: Any, case: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """One case under ``press`` (None: full cache)."""
    from transformers import DynamicCache

    began = time.perf_counter()
    prompt = case["prompt_ids"]
    context = press(model) if press is not None else contextlib.nullcontext()
    with context:
        stepper = Stepper(model, DynamicCache(), 0)
        first = stepper.feed(prompt)
        shared = forced(stepper, first, case["generated_ids"])
        saved_cache, saved_state = copy.deepcopy(stepper.cache), press_state(press)
        position = stepper.position
        questions = []
        for question in case["question_ids"]:
            set_press_state(press, saved_state)
            mine = Stepper(model, copy.deepcopy(saved_cache), position)
            asked = forced(mine, shared["last"], question)
            current, answer = asked["last"], []
            for _ in range(new_tokens):
                token = int(current.argmax())
                answer.append(token)
                current = mine.feed([token])
            questions.append(
                {
                    "top1": asked["top1"],
                    "logprob": asked["logprob"],
                    "answer_ids": answer,
                    "cache_length": int(mine.cache.get_seq_length()),
                }
            )
    return {
        "generated": {"top1": shared["top1"], "logprob": shared["logprob"]},
        "questions": questions,
        "seconds": time.perf_counter() - began,
    }


def main(job_path: str, out_path: str) -> int:
    import kvpress  # noqa: F401
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    with open(job_path) as handle:
        job = json.load(handle)
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    versions = {
        "kvpress": importlib.metadata.version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": str(model.config._attn_implementation),
    }
    output: dict[str, Any] = {"runs": [], "versions": versions, "done": False}
    for spec in job["runs"]:
        press = make_press(job, spec["target_size"])
        run: dict[str, Any] = {**spec, "press": repr(press) if press is not None else None}
        run["cases"] = []
        output["runs"].append(run)
        for index, case in enumerate(job["cases"]):
            run["cases"].append(run_case(model, press, case, int(job["new_tokens"])))
            write(out_path, output)
            print(
                f"kvpress {spec['name']} case {index}: {run['cases'][-1]['seconds']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    output["done"] = True
    write(out_path, output)
    return 0


def write(path: str, output: dict[str, Any]) -> None:
    """Replace ``path`` with ``output`` (written beside it, then renamed)."""
    with open(path + ".tmp", "w") as handle:
        json.dump(output, handle)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
