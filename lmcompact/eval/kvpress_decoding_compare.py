"""kvpress's ``DecodingPress`` beside our decode policies on recall after generation.

The cases of :mod:`lmcompact.eval.recall_after_generation` (a prompt hiding facts, ``N``
tokens of other natural text fed as if generated, one fact's question, greedy answer)
run through

* kvpress 0.5.5's ``DecodingPress`` (SnapKV scorer, ``compression_interval`` = the
  interval, ``target_size`` = the budget) in kvpress's own venv
  (:mod:`lmcompact.eval.kvpress_decoding_worker`): the prompt is prefilled whole (kvpress
  compresses during decoding only), then every later token gets its own forward;
* our :class:`~lmcompact.hf.cache.CompactingCache` with each decode policy, one budget over
  prompt + generation, re-planned every ``interval`` fed tokens (``interval`` tokens per
  forward, as recall_after_generation feeds them);
* the full cache in both environments (the kvpress venv's is the reference of every
  agreement; ours is checked against it).

Per (implementation, budget): accuracy (the needle answered, :func:`tasks.score_needle`),
and over the forced tokens (generated text, counted once per case, and each question)
whose context is longer than the budget: top-1 agreement with the full cache and the
mean |log-prob gap| of the forced token. Usage::

    python -m lmcompact.eval.kvpress_decoding_compare --model smollm2 --context 1024 \\
        --generated 1024 --budgets 512 1024 --samples 3 --out docs/eval/kvpress_decoding_smollm2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

__all__ = ["CaseRun", "Cell", "cell_metrics", "forced_positions", "main"]

KVPRESS = "kvpress DecodingPress"
FULL = "full cache"


@dataclass(frozen=True)
class CaseRun:
    """One case through one cache: per forced token the model's top-1 and the forced
    token's log-prob; ``generated`` for the generated text (the same for every question),
    ``questions`` per question; and each question's greedy answer ids."""

    generated_top1: list[int]
    generated_logprob: list[float]
    question_top1: list[list[int]]
    question_logprob: list[list[float]]
    answers: list[list[int]]
    seconds: float

    @classmethod
    def from_worker(cls, case: dict[str, Any]) -> CaseRun:
        return cls(
            generated_top1=case["generated"]["top1"],
            generated_logprob=case["generated"]["logprob"],
            question_top1=[q["top1"] for q in case["questions"]],
            question_logprob=[q["logprob"] for q in case["questions"]],
            answers=[q["answer_ids"] for q in case["questions"]],
            seconds=case["seconds"],
        )

    def flat(self) -> tuple[list[int], list[float]]:
        """Top-1s and log-probs in :func:`forced_positions` order."""
        top1 = list(self.generated_top1) + [t for q in self.question_top1 for t in q]
        logprob = list(self.generated_logprob) + [x for q in self.question_logprob for x in q]
        return top1, logprob


@dataclass(frozen=True)
class Cell:
    """One implementation/policy at one budget (None: full cache) over every case."""

    impl: str
    policy: str
    budget: int | None
    accuracy: float
    questions: int
    top1_agreement: float | None
    mean_abs_logprob_gap: float | None
    tokens_compared: int
    seconds: float


def forced_positions(prompt: int, generated: int, questions: list[int]) -> list[int]:
    """The context length each forced token is predicted from: the generated tokens once
    (``prompt + j``), then each question's tokens after the generated text."""
    out = [prompt + j for j in range(generated)]
    for length in questions:
        out += [prompt + generated + k for k in range(length)]
    return out


def cell_metrics(
    reference: list[CaseRun],
    runs: list[CaseRun],
    positions: list[list[int]],
    budget: int | None,
) -> tuple[float | None, float | None, int]:
    """Top-1 agreement with ``reference`` and mean |log-prob gap| over the forced tokens
    whose context is longer than ``budget`` (every one for None); None when none is."""
    agree = 0
    gap = 0.0
    n = 0
    for ref, run, where in zip(reference, runs, positions, strict=True):
        ref_top1, ref_logprob = ref.flat()
        top1, logprob = run.flat()
        if not len(ref_top1) == len(top1) == len(where):
            raise ValueError("runs of one case disagree on the forced tokens")
        for i, length in enumerate(where):
            if budget is not None and length <= budget:
                continue
            agree += int(top1[i] == ref_top1[i])
            gap += abs(logprob[i] - ref_logprob[i])
            n += 1
    if n == 0:
        return None, None, 0
    return agree / n, gap / n, n


def _top1_logprob(logits: torch.Tensor, forced: torch.Tensor) -> tuple[list[int], list[float]]:
    """``(T, V)`` logits, ``(T,)`` forced tokens -> top-1s and forced log-probs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.argmax(-1).tolist(), logprobs.gather(1, forced[:, None])[:, 0].tolist()


def run_ours(
    model: Any,
    cases: list[tuple[Any, torch.Tensor]],
    policy: str,
    budget: int | None,
    interval: int,
    new_tokens: int,
    prompt_whole: bool = False,
    params: dict[str, Any] | None = None,
) -> list[CaseRun]:
    """Every case through a :class:`CompactingCache` (``budget`` None: ``DynamicCache``),
    fed like :func:`lmcompact.eval.recall_after_generation.answer`: the prompt in one
    forward, then ``interval`` tokens per forward, then the greedy answer. ``prompt_whole``:
    the prompt is kept whole until the first re-plan, as kvpress does; ``params``: the
    policy's parameters (``decode_cache``)."""
    from transformers import DynamicCache

    from lmcompact.eval.long_generation import decode_cache

    out = []
    for context, generated in cases:
        began = time.perf_counter()
        prompt = torch.tensor(context.context_ids)
        per_question = []
        for question_ids in context.question_ids:
            cache: Any = (
                DynamicCache(config=model.config)
                if budget is None
                else decode_cache(
                    model,
                    policy,
                    budget,
                    len(prompt),
                    interval,
                    prompt_whole=prompt_whole,
                    params=params,
                )
            )
            question = torch.tensor(question_ids)
            forced = torch.cat([generated, question])
            top1: list[int] = []
            logprob: list[float] = []
            with torch.no_grad():
                # ``pending`` rows predict forced[done:], the last one possibly the answer's
                pending = model(prompt[None], past_key_values=cache, use_cache=True).logits[0, -1:]
                done = 0
                for piece in (generated, question):
                    for start in range(0, len(piece), interval):
                        got = _top1_logprob(pending, forced[done : done + len(pending)])
                        top1 += got[0]
                        logprob += got[1]
                        done += len(pending)
                        chunk = piece[start : start + interval][None]
                        pending = model(chunk, past_key_values=cache, use_cache=True).logits[0]
                got = _top1_logprob(pending[:-1], forced[done:])
                top1 += got[0]
                logprob += got[1]
                last = pending[-1]
                answer: list[int] = []
                for _ in range(new_tokens):
                    token = int(last.argmax())
                    answer.append(token)
                    last = model(
                        torch.tensor([[token]]), past_key_values=cache, use_cache=True
                    ).logits[0, -1]
            if len(top1) != len(forced):
                raise RuntimeError(f"{len(top1)} predictions for {len(forced)} forced tokens")
            per_question.append((top1, logprob, answer))
        out.append(_case_from_questions(per_question, len(generated), time.perf_counter() - began))
    return out


def _case_from_questions(
    per_question: list[tuple[list[int], list[float], list[int]]], generated: int, seconds: float
) -> CaseRun:
    """Split each question's forced run into the generated part (taken from the first
    question: identical for every question) and the question's own tokens."""
    first_top1, first_logprob, _ = per_question[0]
    return CaseRun(
        generated_top1=first_top1[:generated],
        generated_logprob=first_logprob[:generated],
        question_top1=[t[generated:] for t, _, _ in per_question],
        question_logprob=[lp[generated:] for _, lp, _ in per_question],
        answers=[a for _, _, a in per_question],
        seconds=seconds,
    )


def accuracy(tokenizer: Any, cases: list[tuple[Any, torch.Tensor]], runs: list[CaseRun]) -> float:
    """Share of questions whose greedy answer is the fact's passkey."""
    from lmcompact.eval.tasks import score_needle

    scores = [
        score_needle(tokenizer.decode(answer), fact.passkey)
        for (context, _), run in zip(cases, runs, strict=True)
        for fact, answer in zip(context.needles, run.answers, strict=True)
    ]
    return sum(scores) / len(scores)


def plot(cells: list[Cell], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = dict.fromkeys((c.impl, c.policy) for c in cells if c.budget is not None)
    fields = (
        ("accuracy", "accuracy (needle answered)"),
        ("top1_agreement", "top-1 agreement with the full cache"),
        ("mean_abs_logprob_gap", "mean |log-prob gap| (nats)"),
    )
    for impl, policy in names:
        mine = sorted(
            (c for c in cells if (c.impl, c.policy) == (impl, policy)), key=lambda c: c.budget or 0
        )
        label = policy if impl == "lmcompact" else f"{impl} ({policy})"
        style = "--" if impl != "lmcompact" else "-"
        for ax, (field, _) in zip(axes, fields, strict=True):
            ys = [getattr(c, field) for c in mine]
            ax.plot([c.budget for c in mine], ys, marker="o", ls=style, label=label)
    full = [c for c in cells if c.budget is None and c.impl == "kvpress"]
    if full:
        axes[0].axhline(full[0].accuracy, color="k", lw=0.8, ls=":", label=FULL)
    for ax, (_, ylabel) in zip(axes, fields, strict=True):
        ax.set(xlabel="budget (tokens per head, prompt + generation)", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from lmcompact.eval.long_generation import POLICIES
    from lmcompact.eval.recall_after_generation import add_case_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(parser, list(POLICIES))
    parser.add_argument("--interval", type=int, default=32)
    parser.add_argument("--window-size", type=int, default=32, help="kvpress SnapKV window")
    parser.add_argument("--kernel-size", type=int, default=7, help="kvpress SnapKV pooling")
    parser.add_argument("--kvpress-python", default=None, help="python of the kvpress venv")
    parser.add_argument(
        "--compact-prompt",
        choices=["prefill", "first-interval"],
        default="prefill",
        help="when our caches first cut the prompt to the budget: at its prefill (the "
        "connector's way), or after the first interval of decoding (kvpress's schedule)",
    )
    parser.add_argument(
        "--policy-params",
        type=json.loads,
        default={},
        help='JSON: parameters per policy replacing the defaults, e.g. \'{"decoding_snapkv": '
        '{"pooling": "avgpool", "window_size": 31}}\'',
    )
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcompact.eval.kvpress_bridge import run_kvpress_decoding
    from lmcompact.eval.recall_after_generation import build_cases
    from lmcompact.hf.attention import enable_lmcompact_attention
    from lmcompact.hf.prepare import prepare_model

    began = time.perf_counter()
    folder = prepare_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    cases = build_cases(tokenizer, args.context, args.generated, args.samples, args.seed)
    jobs = [
        {
            "prompt_ids": list(context.context_ids),
            "generated_ids": generated.tolist(),
            "question_ids": [list(q) for q in context.question_ids],
        }
        for context, generated in cases
    ]
    positions = [
        forced_positions(
            len(context.context_ids), len(generated), [len(q) for q in context.question_ids]
        )
        for context, generated in cases
    ]
    budgets: list[int | None] = [None, *args.budgets]
    # kvpress (one token per forward: the slow side) runs in its own process meanwhile
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(
            run_kvpress_decoding,
            str(folder),
            jobs,
            budgets,
            args.interval,
            args.new_tokens,
            args.window_size,
            args.kernel_size,
            1,
            args.kvpress_python,
        )
        torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        enable_lmcompact_attention(model)
        plans: list[tuple[str, int | None]] = [(FULL, None)]
        plans += [(p, b) for b in args.budgets for p in args.policies]
        ours: dict[tuple[str, int | None], list[CaseRun]] = {}
        for policy, budget in tqdm(plans, desc="lmcompact cells"):
            ours[(policy, budget)] = run_ours(
                model,
                cases,
                policy,
                budget,
                args.interval,
                args.new_tokens,
                prompt_whole=args.compact_prompt == "first-interval",
                params=args.policy_params.get(policy),
            )
        logger.info("lmcompact done; waiting for kvpress")
        output = pending.result()

    kv_runs = {
        run["target_size"]: [CaseRun.from_worker(c) for c in run["cases"]] for run in output["runs"]
    }
    reference = kv_runs[None]
    cells: list[Cell] = []

    def cell(impl: str, policy: str, budget: int | None, runs: list[CaseRun]) -> Cell:
        agree, gap, n = cell_metrics(reference, runs, positions, budget)
        return Cell(
            impl=impl,
            policy=policy,
            budget=budget,
            accuracy=accuracy(tokenizer, cases, runs),
            questions=sum(len(r.answers) for r in runs),
            top1_agreement=agree,
            mean_abs_logprob_gap=gap,
            tokens_compared=n,
            seconds=sum(r.seconds for r in runs),
        )

    for budget, runs in kv_runs.items():
        policy = FULL if budget is None else "DecodingPress+SnapKV"
        cells.append(cell("kvpress", policy, budget, runs))
    for (policy, budget), runs in ours.items():
        cells.append(cell("lmcompact", policy, budget, runs))
    import transformers

    full_check = next(c for c in cells if c.impl == "lmcompact" and c.budget is None)
    report = {
        "model": args.model,
        "context": args.context,
        "generated": args.generated,
        "interval": args.interval,
        "compact_prompt": args.compact_prompt,
        "policy_params": args.policy_params,
        "samples": args.samples,
        "seed": args.seed,
        "new_tokens": args.new_tokens,
        "kvpress_press": {str(r["target_size"]): r["press"] for r in output["runs"]},
        "versions": {
            "kvpress_venv": output["versions"],
            "lmcompact_venv": {
                "transformers": transformers.__version__,
                "torch": torch.__version__,
            },
        },
        "full_cache_check": {
            "note": "lmcompact venv full cache (interval tokens per forward) vs kvpress venv "
            "full cache (one token per forward), every forced token",
            "top1_agreement": full_check.top1_agreement,
            "mean_abs_logprob_gap": full_check.mean_abs_logprob_gap,
            "tokens": full_check.tokens_compared,
        },
        "wall_seconds": time.perf_counter() - began,
        "cells": [asdict(c) for c in cells],
        "answers": {
            "kvpress": {
                str(b): [[tokenizer.decode(a) for a in r.answers] for r in runs]
                for b, runs in kv_runs.items()
            },
            "lmcompact": {
                f"{p} {b}": [[tokenizer.decode(a) for a in r.answers] for r in runs]
                for (p, b), runs in ours.items()
            },
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    title = (
        f"{args.model}: facts in a {args.context}-token prompt, asked after {args.generated} "
        f"more tokens; kvpress DecodingPress (SnapKV) vs lmcompact, re-plan every "
        f"{args.interval}"
    )
    plot(cells, args.out.with_suffix(".png"), title)
    for c in cells:
        shown = "-" if c.top1_agreement is None else f"{c.top1_agreement:.3f}"
        lost = "-" if c.mean_abs_logprob_gap is None else f"{c.mean_abs_logprob_gap:.3f}"
        print(
            f"{c.impl:>9} {c.policy:>22} {c.budget!s:>6} acc {c.accuracy:.3f} "
            f"agree {shown} gap {lost} (n={c.tokens_compared}, {c.seconds:.0f} s)"
        )
    print(f"wall {report['wall_seconds']:.0f} s")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
