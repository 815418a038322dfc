"""Run the quality tasks on a real model: full cache vs every (policy, budget).

For every context length and sample the harness builds one needle prompt and
one perplexity text, runs them once with the full cache (a plain
``DynamicCache``: the reference) and once per (policy, budget) with a
:class:`~lmcompact.hf.cache.CompactingCache` forked from one recorded prefill.
The needle prompt's greedy continuation serves both the ``needle`` score and
the ``agreement`` score (same prompt, same tokens).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcompact.eval import tasks
from lmcompact.eval.policies import policy_for
from lmcompact.eval.text import text_stream

logger = logging.getLogger(__name__)

TASKS = ("needle", "agreement", "ppl")


@dataclass
class EvalConfig:
    """What one ``lmcompact eval`` run measures (validated in ``__post_init__``)."""

    model: str = "smollm2"
    policies: list[str] = field(default_factory=lambda: ["none"])
    budgets: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.25, 0.1])
    contexts: list[int] = field(default_factory=lambda: [1024])
    samples: int = 2
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    new_tokens: int = 24
    ppl_tokens: int = 128
    depths: list[float] = field(default_factory=lambda: [0.5])
    haystack: str = "passkey"
    prompt_format: str = "plain"
    seed: int = 0
    threads: int | None = None
    """torch CPU threads for both lmcompact and the kvpress worker (None: torch's default)."""

    def __post_init__(self) -> None:
        if self.haystack not in tasks.HAYSTACKS:
            raise ValueError(
                f"unknown haystack {self.haystack!r}; allowed: {', '.join(tasks.HAYSTACKS)}"
            )
        if self.prompt_format not in tasks.PROMPT_FORMATS:
            raise ValueError(
                f"unknown prompt format {self.prompt_format!r}; allowed: "
                f"{', '.join(tasks.PROMPT_FORMATS)}"
            )
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"unknown tasks {bad or self.tasks}; allowed: {', '.join(TASKS)}")
        for budget in self.budgets:
            if not 0.0 < budget <= 1.0:
                raise ValueError(f"budgets must be ratios in (0, 1], got {budget}")
        for context in self.contexts:
            if context < 128:
                raise ValueError(f"context must be >= 128 tokens, got {context}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.samples < 1 or self.new_tokens < 1 or self.ppl_tokens < 2:
            raise ValueError(
                f"samples and new_tokens must be >= 1 and ppl_tokens >= 2; got {self.samples}, "
                f"{self.new_tokens}, {self.ppl_tokens}"
            )


@dataclass
class Sample:
    """Inputs of one (context, sample): a needle prompt and a perplexity split."""

    context: int
    index: int
    needle: tasks.NeedlePrompt
    ppl_context: list[int]
    ppl_continuation: list[int]
    reference: list[int] | None = None
    """Greedy tokens of the full cache on the needle prompt (set by :func:`run_sample`)."""


def build_samples(tokenizer: Any, config: EvalConfig) -> list[Sample]:
    """Deterministic prompts for every (context, sample index)."""
    out = []
    for context in config.contexts:
        for index in range(config.samples):
            seed = config.seed * 1000 + index
            needle = tasks.build_needle_prompt(
                tokenizer,
                context,
                seed,
                depths=config.depths,
                haystack=config.haystack,
                prompt_format=config.prompt_format,
                text=text_stream(seed) if config.haystack == "pydoc" else None,
            )
            ppl_ids = tokenizer(text_stream(seed, skip=200), add_special_tokens=False)["input_ids"]
            need = context + config.ppl_tokens
            if len(ppl_ids) < need:
                raise ValueError(f"not enough text for context {context} + {config.ppl_tokens}")
            out.append(Sample(context, index, needle, ppl_ids[:context], ppl_ids[context:need]))
    return out


class ModelRunner:
    """Prefill once per prompt, then compact and decode once per (policy, budget).

    Compaction happens after the prefill forward, so the prefill (and its
    logits) is the same for every policy: a recorder cache captures dense K/V
    and every score once, and each configuration forks from it. Greedy decoding
    is a plain loop (argmax, stop at EOS), the same for the full cache.
    """

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from lmcompact.hf.attention import enable_lmcompact_attention

        self.model = enable_lmcompact_attention(model)
        self.tokenizer = tokenizer
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}

    @torch.no_grad()
    def prefill(self, ids: list[int], full: bool = False) -> tuple[Any, torch.Tensor, float]:
        """Run the prompt; returns (cache, last logits ``(V,)``, seconds).

        ``full=True`` uses a plain DynamicCache (the reference); otherwise a
        recorder :class:`~lmcompact.hf.cache.CompactingCache` to fork from.
        """
        from transformers import DynamicCache

        from lmcompact.hf.cache import CompactingCache

        cache = (
            DynamicCache(config=self.model.config)
            if full
            else CompactingCache.recorder(self.model, self.tokenizer)
        )
        start = time.perf_counter()
        logits = self.model(torch.tensor([ids]), past_key_values=cache).logits[0, -1]
        return cache, logits, time.perf_counter() - start

    @torch.no_grad()
    def greedy(self, cache: Any, first: torch.Tensor, new_tokens: int) -> list[int]:
        """Greedy tokens continuing from logits ``first`` with ``cache``."""
        tokens = [int(first.argmax())]
        while len(tokens) < new_tokens and tokens[-1] not in self.eos:
            step = self.model(torch.tensor([[tokens[-1]]]), past_key_values=cache).logits[0, -1]
            tokens.append(int(step.argmax()))
        return tokens

    @torch.no_grad()
    def continuation_nll(self, cache: Any, first: torch.Tensor, continuation: list[int]) -> float:
        """Summed NLL of ``continuation`` given the context's last logits and its cache."""
        rest = self.model(torch.tensor([continuation[:-1]]), past_key_values=cache).logits[0]
        logits = torch.cat([first[None], rest]).float()
        return float(
            torch.nn.functional.cross_entropy(logits, torch.tensor(continuation), reduction="sum")
        )


def _cache_facts(cache: Any) -> dict[str, Any]:
    return {
        "kept_ratio": cache.kept_ratio(),
        "cache_bytes": cache.nbytes(),
        "full_bytes": cache.full_nbytes(),
        "compaction_s": cache.stats["observe_s"] + cache.stats["compact_s"],
        "scores_s": cache.stats["observe_s"],
        "select_s": cache.stats["compact_s"],
        "decode_compaction_s": cache.stats["decode_compact_s"],
    }


def configurations(config: EvalConfig) -> Iterator[tuple[str, float]]:
    for name in config.policies:
        for budget in config.budgets:
            yield name, budget


def run_sample(
    runner: ModelRunner, sample: Sample, config: EvalConfig, progress: Any = None
) -> list[dict[str, Any]]:
    """Every configuration on one sample; returns per-sample result rows."""
    rows: list[dict[str, Any]] = []
    base = {"context": sample.context, "sample": sample.index, "impl": "lmcompact"}
    wants_gen = "needle" in config.tasks or "agreement" in config.tasks
    wants_ppl = "ppl" in config.tasks
    passkey = sample.needle.target.passkey
    ids = sample.needle.input_ids
    full_ppl = None
    if wants_gen:
        cache, first, seconds = runner.prefill(ids, full=True)
        start = time.perf_counter()
        sample.reference = runner.greedy(cache, first, config.new_tokens)
        text = runner.tokenizer.decode(sample.reference)
        rows.append(
            {
                **base,
                "task": "needle",
                "policy": "full",
                "budget": 1.0,
                "accuracy": tasks.score_needle(text, passkey),
                "kept_ratio": 1.0,
                "answer": text,
                "prefill_s": seconds,
                "decode_s": time.perf_counter() - start,
            }
        )
        recorder, needle_first, needle_prefill_s = runner.prefill(ids)
    if wants_ppl:
        cache, first, seconds = runner.prefill(sample.ppl_context, full=True)
        nll = runner.continuation_nll(cache, first, sample.ppl_continuation)
        full_ppl = tasks.perplexity(nll, len(sample.ppl_continuation))
        rows.append(
            {
                **base,
                "task": "ppl",
                "policy": "full",
                "budget": 1.0,
                "kept_ratio": 1.0,
                "ppl": full_ppl,
                "prefill_s": seconds,
            }
        )
        ppl_recorder, ppl_first, _ = runner.prefill(sample.ppl_context)
    for name, budget in configurations(config):
        here = {**base, "policy": name, "budget": budget}
        if wants_gen:
            cache = recorder.fork(policy_for(name, budget, sample.context))
            start = time.perf_counter()
            got = runner.greedy(cache, needle_first, config.new_tokens)
            decode_s = time.perf_counter() - start
            facts = _cache_facts(cache)
            text = runner.tokenizer.decode(got)
            if "needle" in config.tasks:
                rows.append(
                    {
                        **here,
                        "task": "needle",
                        "answer": text,
                        "accuracy": tasks.score_needle(text, passkey),
                        "prefill_s": needle_prefill_s,
                        "decode_s": decode_s,
                        **facts,
                    }
                )
            if "agreement" in config.tasks:
                agree = tasks.agreement(sample.reference or [], got)
                rows.append(
                    {
                        **here,
                        "task": "agreement",
                        "accuracy": agree.token_accuracy,
                        "first_divergence": agree.first_divergence,
                        "n": agree.n,
                        "decode_s": decode_s,
                        **facts,
                    }
                )
        if wants_ppl:
            cache = ppl_recorder.fork(policy_for(name, budget, sample.context))
            nll = runner.continuation_nll(cache, ppl_first, sample.ppl_continuation)
            rows.append(
                {
                    **here,
                    "task": "ppl",
                    "ppl": tasks.perplexity(nll, len(sample.ppl_continuation)),
                    "ppl_full": full_ppl,
                    **_cache_facts(cache),
                }
            )
        if progress is not None:
            progress.update(1)
    return rows


def load_model(name_or_path: str) -> tuple[Any, Any, str]:
    """Prepare (if needed) and load a model in float32 with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcompact.hf.prepare import prepare_model

    folder = prepare_model(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return model, tokenizer, str(folder)
