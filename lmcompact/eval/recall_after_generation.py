"""Recall after a long generation: is a fact of the prompt still answerable once the model
has written ``N`` more tokens under a decode budget?

The prompt hides facts in natural text (:func:`lmcompact.eval.tasks.build_stored_context`);
``N`` tokens of other natural text are then fed as if the model had written them (teacher
forcing: a small model's own greedy text repeats itself, ``long_generation_smollm2.md``),
``interval`` per forward through a :class:`~lmcompact.hf.cache.CompactingCache` that
re-plans back to the decode budget after each; then one fact's question is asked and the
answer decoded greedily::

    prompt (facts at depths) | N "generated" tokens | question -> answer   (one run per question)

The full cache (no compaction) runs the same cases. Usage::

    python -m lmcompact.eval.recall_after_generation --model smollm2 --context 1024 \\
        --generated 1024 --budgets 512 1024 --samples 3 --out docs/eval/recall_smollm2
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lmcompact.eval.long_generation import POLICIES, decode_cache
from lmcompact.eval.tasks import StoredContext, build_stored_context, score_needle

logger = logging.getLogger(__name__)

FULL = "full cache"
"""``policy`` of the rows without compaction."""

DEPTHS = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class RecallCell:
    """Accuracy of one policy at one decode budget over every (sample, question)."""

    policy: str
    budget: int | None
    accuracy: float
    n: int
    decode_compactions: int
    seconds: float


def answer(
    model: Any,
    cache: Any,
    pieces: list[torch.Tensor],
    interval: int,
    new_tokens: int,
) -> list[int]:
    """Feed ``pieces`` (each ``(T,)``) through ``cache``, ``interval`` tokens per forward
    after the first piece, then decode ``new_tokens`` greedily."""
    with torch.no_grad():
        logits = model(pieces[0][None], past_key_values=cache, use_cache=True).logits
        for piece in pieces[1:]:
            for start in range(0, len(piece), interval):
                chunk = piece[start : start + interval][None]
                logits = model(chunk, past_key_values=cache, use_cache=True).logits
        out: list[int] = []
        for _ in range(new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
    return out


def run_cell(
    model: Any,
    tokenizer: Any,
    cases: list[tuple[StoredContext, torch.Tensor]],
    policy: str,
    budget: int | None,
    interval: int,
    new_tokens: int,
    prompt_budget: float | None = None,
) -> RecallCell:
    """Every question of every case with ``policy`` at ``budget`` (None: the full cache)."""
    from transformers import DynamicCache

    start = time.perf_counter()
    scores = []
    compactions = 0
    for context, generated in cases:
        prompt = torch.tensor(context.context_ids)
        for index, fact in enumerate(context.needles):
            cache: Any = (
                DynamicCache(config=model.config)
                if budget is None
                else decode_cache(model, policy, budget, len(prompt), interval, prompt_budget)
            )
            question = torch.tensor(context.question_ids[index])
            ids = answer(model, cache, [prompt, generated, question], interval, new_tokens)
            scores.append(score_needle(tokenizer.decode(ids), fact.passkey))
            if budget is not None:
                compactions += int(cache.stats["decode_compactions"])
    return RecallCell(
        policy=policy,
        budget=budget,
        accuracy=sum(scores) / len(scores),
        n=len(scores),
        decode_compactions=compactions,
        seconds=time.perf_counter() - start,
    )


def build_cases(
    tokenizer: Any, context: int, generated: int, samples: int, seed: int
) -> list[tuple[StoredContext, torch.Tensor]]:
    """``samples`` (prompt with facts, generated-text ids) pairs; the generated text comes
    from another part of the text than the prompt's haystack."""
    from lmcompact.eval.text import text_stream

    cases = []
    for sample in range(samples):
        stored = build_stored_context(
            tokenizer, context, seed + sample, DEPTHS, text_stream(seed + sample)
        )
        other = tokenizer(text_stream(seed + sample + 1000), add_special_tokens=False)
        cases.append((stored, torch.tensor(other["input_ids"][:generated])))
    return cases


def plot(cells: list[RecallCell], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    full = [c for c in cells if c.budget is None]
    for name in dict.fromkeys(c.policy for c in cells if c.budget is not None):
        mine = sorted((c for c in cells if c.policy == name), key=lambda c: c.budget or 0)
        ax.plot([c.budget or 0 for c in mine], [c.accuracy for c in mine], marker="o", label=name)
    if full:
        ax.axhline(full[0].accuracy, color="k", lw=0.8, ls="--", label=FULL)
    ax.set(xlabel="decode budget (tokens per head)", ylabel="accuracy", ylim=(-0.05, 1.05))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_case_arguments(parser: argparse.ArgumentParser, policies: list[str]) -> None:
    """The options of the recall cases and cells, shared with the vLLM run
    (:mod:`lmcompact.eval.vllm_recall`)."""
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--generated", type=int, default=1024, help="tokens written after it")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--policies", nargs="+", default=policies)
    parser.add_argument("--samples", type=int, default=3, help="prompts (3 questions each)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="path without suffix")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(parser, list(POLICIES))
    parser.add_argument("--interval", type=int, default=32)
    parser.add_argument(
        "--prompt-budget",
        type=float,
        default=None,
        help="kept share of the prompt; the decode budget then bounds generated tokens only "
        "(default: one budget for prompt and generation together)",
    )
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcompact.hf.attention import enable_lmcompact_attention
    from lmcompact.hf.prepare import prepare_model

    folder = prepare_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    enable_lmcompact_attention(model)
    cases = build_cases(tokenizer, args.context, args.generated, args.samples, args.seed)
    plans: list[tuple[str, int | None]] = [(FULL, None)]
    plans += [(p, b) for b in args.budgets for p in args.policies]
    cells = []
    for policy, budget in tqdm(plans, desc="cells"):
        cell = run_cell(
            model,
            tokenizer,
            cases,
            policy,
            budget,
            args.interval,
            args.new_tokens,
            args.prompt_budget,
        )
        logger.info("%s", cell)
        cells.append(cell)
    report = {
        "model": args.model,
        "context": args.context,
        "generated": args.generated,
        "interval": args.interval,
        "samples": args.samples,
        "depths": list(DEPTHS),
        "seed": args.seed,
        "prompt_budget": args.prompt_budget,
        "dtype": "float32",
        "cells": [asdict(c) for c in cells],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    title = (
        f"{args.model}: facts in a {args.context}-token prompt, asked after "
        f"{args.generated} more tokens (re-plan every {args.interval}"
        + ("" if args.prompt_budget is None else f", prompt kept {args.prompt_budget:g}")
        + ")"
    )
    plot(cells, args.out.with_suffix(".png"), title)
    for c in cells:
        print(f"{c.policy:>16} {c.budget!s:>6} {c.accuracy:.3f} (n={c.n}, {c.seconds:.0f} s)")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
