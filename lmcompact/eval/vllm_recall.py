"""Recall after a long generation, through vLLM and the connector's decode budget.

The engine counterpart of :mod:`lmcompact.eval.recall_after_generation` (same cases: facts
in a natural-text prompt, ``N`` tokens of other natural text written after it, then one
fact's question, answered greedily). Here a real vLLM engine decodes every one of those
tokens (forced by :class:`connectors.vllm.forced_tokens.ForcedTokens`), configured only by its
``kv_connector_extra_config``: ``"release": {"decode_budget_tokens": B, "decode_policy": P}``
with policy ``none`` for the prompt, so one budget bounds prompt and generation together;
with ``--prompt-budget p`` the prompt is packed by SnapKV to ``p`` at its end and the decode
budget bounds what lies outside the hole: the ``S`` kept prompt tokens plus at most
``max(B, S) - S`` tokens after them (:mod:`lmcompact.compaction.admission`), so give budgets
above ``S`` to keep generated text besides the prompt. ``--protect-prompt`` sets
``release.protect_prompt``: the budget then counts generated tokens only.
The full cache is the same engine without the connector. Per cell: accuracy over every
(sample, question), and on the forced tokens (from the ones after the budget is first
reached) the share where the compacted engine's own top-1 equals the full cache's and the
mean absolute log-probability gap to it::

    python -m lmcompact.eval.vllm_recall --model smollm2 --context 1024 --generated 1024 \\
        --budgets 512 1024 --policies recent decoding_snapkv rkv --out docs/eval/vllm_recall_smollm2
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lmcompact.eval.recall_after_generation import (
    DEPTHS,
    FULL,
    add_case_arguments,
    build_cases,
)
from lmcompact.eval.tasks import score_needle

logger = logging.getLogger(__name__)

BLOCK = 32


@dataclass(frozen=True)
class EngineCell:
    """One decode policy at one budget (or the full cache) over every (sample, question)."""

    policy: str
    budget: int | None
    accuracy: float
    n: int
    top1_agreement: float | None
    mean_abs_logprob_gap: float | None
    answers: list[str]
    seconds: float
    tokens_compared: int = 0


def _extra(
    policy: str, budget: int, prompt_budget: float | None, protect_prompt: bool = False
) -> dict[str, Any]:
    """One budget over prompt and generation (``prompt_budget`` None), or the prompt packed
    by SnapKV at its end to ``prompt_budget`` and the decode budget over what follows; with
    ``protect_prompt`` the budget counts generated tokens only (the kept prompt stays)."""
    release: dict[str, Any] = {"decode_budget_tokens": budget, "decode_policy": policy}
    if protect_prompt:
        release["protect_prompt"] = True
    if prompt_budget is None:
        return {"policy": "none", "store": False, "release": release}
    return {"policy": "snapkv", "budget": prompt_budget, "store": False,
            "release": {**release, "prefill": "pack"}}  # fmt: skip


def run_cell(
    model: str, tokenizer: Any, requests: list[tuple[list[int], list[int], str]],
    policy: str, budget: int | None, new_tokens: int, max_model_len: int,
    prompt_budget: float | None = None, protect_prompt: bool = False,
) -> tuple[EngineCell, list[tuple[list[int], list[float]]]]:  # fmt: skip
    """All requests through one engine; returns the cell and per request (top-1, log-probs)
    over its forced tokens."""
    from connectors.vllm.forced_tokens import ForcedTokens, forced_params, step_predictions
    from connectors.vllm.offline import engine

    began = time.perf_counter()
    extra = None if budget is None else _extra(policy, budget, prompt_budget, protect_prompt)
    with engine(model, extra, max_model_len=max_model_len, logits_processors=[ForcedTokens]) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": prompt} for prompt, _, _ in requests],
            [forced_params(forced, new_tokens) for _, forced, _ in requests],
            use_tqdm=False,
        )
    answers, scores, steps = [], [], []
    for out, (_, forced, passkey) in zip(outs, requests, strict=True):
        tokens = list(out.outputs[0].token_ids)
        if tokens[: len(forced)] != forced:
            raise RuntimeError(f"{policy}: the engine did not keep the forced tokens")
        text = tokenizer.decode(tokens[len(forced) :], skip_special_tokens=True)
        answers.append(text)
        scores.append(score_needle(text, passkey))
        steps.append(step_predictions(out.outputs[0], forced))
    cell = EngineCell(
        policy=FULL if budget is None else policy,
        budget=budget,
        accuracy=sum(scores) / len(scores),
        n=len(scores),
        top1_agreement=None,
        mean_abs_logprob_gap=None,
        answers=answers,
        seconds=time.perf_counter() - began,
    )
    return cell, steps


def compare(
    cell: EngineCell,
    steps: list[tuple[list[int], list[float]]],
    full: list[tuple[list[int], list[float]]],
    skip: list[int],
) -> EngineCell:
    """``cell`` with agreement and gap against the full cache, forced steps ``skip[i]`` on."""
    same, gaps = 0, []
    for (top, lps), (full_top, full_lps), first in zip(steps, full, skip, strict=True):
        for i in range(first, len(top)):
            same += top[i] == full_top[i]
            gaps.append(abs(lps[i] - full_lps[i]))
    n = max(len(gaps), 1)
    return EngineCell(**{**asdict(cell), "top1_agreement": same / n,
                         "mean_abs_logprob_gap": sum(gaps) / n,
                         "tokens_compared": len(gaps)})  # fmt: skip


def plot(cells: list[EngineCell], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    full = next(c for c in cells if c.budget is None)
    budgets = sorted({c.budget for c in cells if c.budget is not None})
    for policy in sorted({c.policy for c in cells if c.budget is not None}):
        row = {c.budget: c for c in cells if c.policy == policy}
        left.plot(budgets, [row[b].accuracy for b in budgets], marker="o", label=policy)
        right.plot(budgets, [row[b].top1_agreement for b in budgets], marker="o", label=policy)
    left.axhline(full.accuracy, color="gray", ls="--", label=FULL)
    left.set(xlabel="decode budget (tokens)", ylabel="accuracy", title="recall after generation",
             ylim=(-0.05, 1.05))  # fmt: skip
    right.set(xlabel="decode budget (tokens)", ylabel="top-1 agreement with the full cache",
              title="forced tokens past the budget")  # fmt: skip
    left.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(parser, ["recent", "decoding_snapkv", "rkv"])
    parser.add_argument(
        "--prompt-budget", type=float, default=None,
        help="pack the prompt to this kept share at its end (SnapKV); the decode budget then "
        "bounds the kept prompt plus what follows (default: one budget over prompt and "
        "generation, the prompt not packed)",
    )  # fmt: skip
    parser.add_argument(
        "--protect-prompt", action="store_true",
        help="release.protect_prompt: the decode budget counts generated tokens only, the "
        "prompt (or its packed kept tokens) stays whole",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if any(b % BLOCK for b in args.budgets):
        raise SystemExit(f"--budgets must be multiples of the block size {BLOCK}")
    from connectors.vllm.offline import in_process_env

    in_process_env()  # one process, and a 2 GiB KV pool rather than most of the machine's memory
    from transformers import AutoTokenizer

    from lmcompact.hf.prepare import prepare_model

    model = str(prepare_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests, counted = [], []
    for stored, generated in build_cases(
        tokenizer, args.context, args.generated, args.samples, args.seed
    ):
        for index, fact in enumerate(stored.needles):
            forced = generated.tolist() + list(stored.question_ids[index])
            requests.append((stored.context_ids, forced, fact.passkey))
            # tokens the budget counts before the first forced one: the prompt, unless it
            # is protected (only generated tokens count) or packed (compacted at once)
            counted.append(0 if args.protect_prompt else len(stored.context_ids))

    def skip(budget: int | None) -> list[int]:
        """Per request, the first forced step a cell's budget binds at (its agreement and
        gap count from there): at once with a packed prompt, else once the counted tokens
        exceed the budget."""
        if args.prompt_budget is not None or budget is None:
            return [0] * len(counted)
        return [max(0, budget - before) for before in counted]

    longest = max(len(p) + len(f) for p, f, _ in requests) + args.new_tokens
    max_model_len = -(-longest // BLOCK) * BLOCK
    plans: list[tuple[str, int | None]] = [(FULL, None)]
    plans += [(p, b) for b in args.budgets for p in args.policies]
    cells: list[EngineCell] = []
    full_steps: list[tuple[list[int], list[float]]] = []
    for policy, budget in tqdm(plans, desc="cells"):
        cell, steps = run_cell(
            model, tokenizer, requests, policy, budget, args.new_tokens, max_model_len,
            args.prompt_budget, args.protect_prompt,
        )  # fmt: skip
        if budget is None:
            full_steps = steps
        cell = compare(cell, steps, full_steps, skip(budget))
        logger.info("%s %s: accuracy %.3f, agreement %.3f", policy, budget, cell.accuracy,
                    cell.top1_agreement)  # fmt: skip
        cells.append(cell)
    report = {
        "model": args.model,
        "engine": "vllm (CPU), float32, block 32, connector release group",
        "context": args.context,
        "generated": args.generated,
        "samples": args.samples,
        "depths": list(DEPTHS),
        "seed": args.seed,
        "prompt_budget": args.prompt_budget,
        "protect_prompt": args.protect_prompt,
        "budget_covers": (
            "generated tokens only (release.protect_prompt: the prompt's kept tokens stay)"
            if args.protect_prompt
            else "prompt and generated tokens together (policy none at prefill)"
            if args.prompt_budget is None
            else "the packed prompt's kept tokens plus the tokens after them (prompt packed "
            "by snapkv to prompt_budget at its end)"
        ),
        "cells": [asdict(c) for c in cells],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    title = (
        f"{args.model} in vLLM: facts in a {args.context}-token prompt, asked after "
        f"{args.generated} more decoded tokens"
        + ("" if args.prompt_budget is None else f" (prompt packed to {args.prompt_budget:g})")
        + (", budget over generated tokens" if args.protect_prompt else "")
    )
    plot(cells, args.out.with_suffix(".png"), title)
    for c in cells:
        print(f"{c.policy:>16} {c.budget!s:>6} accuracy {c.accuracy:.3f} (n={c.n}) "
              f"agreement {c.top1_agreement:.3f} gap {c.mean_abs_logprob_gap:.3f} "
              f"over {c.tokens_compared} tokens "
              f"{c.seconds:.0f} s")  # fmt: skip


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
