"""Long-generation quality: the full cache's greedy text, teacher-forced through compaction.

A model-agnostic measure of decode-time compaction: the model generates greedily with its
full cache; the same tokens are then fed through a :class:`~lmcompact.hf.cache.CompactingCache`
whose decode policy re-plans every ``interval`` tokens back to a decode budget. Per generated
token: does the compacted model's top-1 still pick the full cache's token (agreement), and
how much log-probability does it lose on it (gap = full - compacted, in nats)::

    prompt | g1 g2 ... gN          full cache: greedy g, log p_full(g_i | prompt, g_<i)
    prompt | g1 .. g32 | g33 ..    compacted: fed 32 tokens per forward (the re-plan interval),
                                   log p_comp(g_i | ...), argmax == g_i ?

Usage::

    python -m lmcompact.eval.long_generation --model smollm2 --prompt-tokens 256 \\
        --new-tokens 1536 --budgets 512 1024 --out docs/eval/long_generation_smollm2
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

logger = logging.getLogger(__name__)

__all__ = ["ForcedRun", "decode_cache", "forced_logprobs", "full_generation", "main"]

POLICIES: dict[str, dict[str, Any]] = {
    "streaming_llm": {},  # "recent": sinks + the most recent tokens
    "decoding_snapkv": {"window_size": 32},
    "rkv": {"window_size": 8},
}


@dataclass(frozen=True)
class ForcedRun:
    """One policy at one decode budget, teacher-forced over the full cache's generation."""

    policy: str
    budget: int
    top1_agreement: float
    mean_logprob_gap: float
    tokens: int
    decode_compactions: int
    seconds: float


def full_generation(
    model: Any, prompt: torch.Tensor, new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``(N,)`` tokens after ``prompt`` ``(1, P)`` with a full cache, and ``(N,)``
    their log-probabilities."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = model.generate(
            prompt,
            past_key_values=DynamicCache(config=model.config),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, prompt.shape[1] :]
    logits = torch.stack([step[0] for step in out.logits])  # (N, vocab)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def forced_logprobs(
    model: Any, cache: Any, prompt: torch.Tensor, tokens: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed ``prompt`` then ``tokens[:-1]`` (``chunk`` per forward) through ``cache``:
    ``(N,)`` log-probabilities of ``tokens`` and ``(N,)`` bool, top-1 equals the token."""
    with torch.no_grad():
        logits = [model(prompt, past_key_values=cache, use_cache=True).logits[0, -1:]]
        for start in range(0, len(tokens) - 1, chunk):
            piece = tokens[start : min(start + chunk, len(tokens) - 1)][None]
            logits.append(model(piece, past_key_values=cache, use_cache=True).logits[0])
    stacked = torch.log_softmax(torch.cat(logits).float(), dim=-1)
    return stacked.gather(1, tokens[:, None])[:, 0], stacked.argmax(dim=-1) == tokens


def decode_cache(
    model: Any,
    policy: str,
    budget: int,
    prompt_len: int,
    interval: int,
    prompt_budget: float | None = None,
    prompt_whole: bool = False,
    params: dict[str, Any] | None = None,
) -> Any:
    """A :class:`~lmcompact.hf.cache.CompactingCache` whose ``policy`` keeps ``budget``
    tokens per (layer, head), re-planned every ``interval`` fed tokens. ``prompt_budget``
    None: one budget for everything, the prompt compacted to it too when longer (else kept
    whole); a fraction: the policy keeps that share of the prompt at its end and the budget
    bounds the generated tokens only (``protect_prompt``, vLLM's release-group split).
    ``prompt_whole``: the prefill keeps the whole prompt, the first re-plan (after the
    first ``interval`` fed tokens) cuts it to ``budget`` (kvpress ``DecodingPress``'s
    schedule: it compresses during decoding only). ``params`` replace the policy's
    parameters of :data:`POLICIES`."""
    from lmcompact.hf.cache import CompactingCache
    from lmcompact.policies import make_policy

    params = dict(POLICIES.get(policy, {}) if params is None else params)
    if prompt_budget is not None:
        instance = make_policy(policy, budget=prompt_budget, **params)
        return CompactingCache(
            model,
            instance,
            decode_slack=interval - 1,
            decode_budget=budget,
            protect_prompt=True,
            window_size=None,
        )
    prefill: float | int = budget if budget < prompt_len and not prompt_whole else 1.0
    instance = make_policy(policy, budget=prefill, **params)
    return CompactingCache(
        model, instance, decode_slack=interval - 1, decode_budget=budget, window_size=None
    )


def run_policy(
    model: Any,
    prompt: torch.Tensor,
    tokens: torch.Tensor,
    full: torch.Tensor,
    policy: str,
    budget: int,
    interval: int,
) -> ForcedRun:
    """One :class:`ForcedRun`: ``policy`` keeps ``budget`` tokens per (layer, head)."""
    cache = decode_cache(model, policy, budget, prompt.shape[1], interval)
    start = time.perf_counter()
    logprobs, agree = forced_logprobs(model, cache, prompt, tokens, interval)
    return ForcedRun(
        policy=policy,
        budget=budget,
        top1_agreement=float(agree.float().mean()),
        mean_logprob_gap=float((full - logprobs).mean()),
        tokens=len(tokens),
        decode_compactions=int(cache.stats["decode_compactions"]),
        seconds=time.perf_counter() - start,
    )


def plot(runs: list[ForcedRun], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r.policy for r in runs):
        mine = sorted((r for r in runs if r.policy == name), key=lambda r: r.budget)
        budgets = [r.budget for r in mine]
        axes[0].plot(budgets, [r.top1_agreement for r in mine], marker="o", label=name)
        axes[1].plot(budgets, [r.mean_logprob_gap for r in mine], marker="o", label=name)
    axes[0].set(xlabel="decode budget (tokens per head)", ylabel="top-1 agreement")
    axes[1].set(xlabel="decode budget (tokens per head)", ylabel="mean log-prob gap (nats)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=1536)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--interval", type=int, default=32)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="path without suffix")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcompact.eval.text import text_stream
    from lmcompact.hf.attention import enable_lmcompact_attention
    from lmcompact.hf.prepare import prepare_model

    folder = prepare_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = tokenizer(text_stream(args.seed), add_special_tokens=False)["input_ids"]
    prompt = torch.tensor([ids[: args.prompt_tokens]])
    start = time.perf_counter()
    tokens, full = full_generation(model, prompt, args.new_tokens)
    logger.info("full generation: %d tokens in %.1f s", len(tokens), time.perf_counter() - start)
    enable_lmcompact_attention(model)
    runs = []
    for budget in args.budgets:
        for policy in args.policies:
            run = run_policy(model, prompt, tokens, full, policy, budget, args.interval)
            logger.info("%s", run)
            runs.append(run)
    report = {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "interval": args.interval,
        "seed": args.seed,
        "dtype": "float32",
        "distinct_generated_tokens": len(set(tokens.tolist())),
        "runs": [asdict(r) for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    title = (
        f"{args.model}: {args.new_tokens} greedy tokens after {args.prompt_tokens}, "
        f"teacher-forced, re-plan every {args.interval}"
    )
    plot(runs, args.out.with_suffix(".png"), title)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
