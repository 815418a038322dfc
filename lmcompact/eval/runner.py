"""Run the quality tasks on a real model: full cache vs every (policy, budget).

For every context length and sample the harness builds one needle prompt and
one perplexity text, runs them once with the full cache (a plain
``DynamicCache``: the reference) and once per (policy, budget) with a
:class:`~lmcompact.hf.cache.CompactingCache`. The needle prompt's greedy
continuation serves both the ``needle`` score and the ``agreement`` score (same
prompt, same tokens), so each configuration costs one needle prefill plus, with
``ppl``, one perplexity prefill.
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
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"unknown tasks {bad or self.tasks}; allowed: {', '.join(TASKS)}")
        for budget in self.budgets:
            if not 0.0 < budget <= 1.0:
                raise ValueError(f"budgets must be ratios in (0, 1], got {budget}")
        for context in self.contexts:
            if context < 128:
                raise ValueError(f"context must be >= 128 tokens, got {context}")
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
                tokenizer, text_stream(seed), context, seed, depths=config.depths
            )
            ppl_ids = tokenizer(text_stream(seed, skip=200), add_special_tokens=False)["input_ids"]
            need = context + config.ppl_tokens
            if len(ppl_ids) < need:
                raise ValueError(f"not enough text for context {context} + {config.ppl_tokens}")
            out.append(Sample(context, index, needle, ppl_ids[:context], ppl_ids[context:need]))
    return out


class ModelRunner:
    """Greedy generation and continuation NLL with a full or compacting cache."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from lmcompact.hf.attention import enable_lmcompact_attention

        self.model = enable_lmcompact_attention(model)
        self.tokenizer = tokenizer

    def _cache(self, policy: Any) -> Any:
        from transformers import DynamicCache

        from lmcompact.hf.cache import CompactingCache

        if policy is None:
            return DynamicCache(config=self.model.config)
        return CompactingCache(self.model, policy, tokenizer=self.tokenizer)

    @torch.no_grad()
    def generate(self, ids: list[int], policy: Any, new_tokens: int) -> dict[str, Any]:
        """Greedy ``new_tokens`` after ``ids``; ``policy=None`` is the full cache."""
        cache = self._cache(policy)
        input_ids = torch.tensor([ids])
        start = time.perf_counter()
        out = self.model.generate(
            input_ids,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=self.tokenizer.eos_token_id,
        )
        elapsed = time.perf_counter() - start
        tokens = out[0, len(ids) :].tolist()
        return {
            "tokens": tokens,
            "text": self.tokenizer.decode(tokens),
            "seconds": elapsed,
            **_cache_facts(cache),
        }

    @torch.no_grad()
    def continuation_nll(
        self, context: list[int], continuation: list[int], policy: Any
    ) -> dict[str, Any]:
        """Summed NLL of ``continuation`` after ``context`` (compacted at its end)."""
        cache = self._cache(policy)
        start = time.perf_counter()
        first = self.model(torch.tensor([context]), past_key_values=cache).logits[0, -1]
        rest = self.model(torch.tensor([continuation[:-1]]), past_key_values=cache).logits[0]
        logits = torch.cat([first[None], rest]).float()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(continuation), reduction="sum")
        return {
            "nll_sum": float(nll),
            "count": len(continuation),
            "seconds": time.perf_counter() - start,
            **_cache_facts(cache),
        }


def _cache_facts(cache: Any) -> dict[str, Any]:
    from lmcompact.hf.cache import CompactingCache

    if not isinstance(cache, CompactingCache):
        return {}
    return {
        "kept_ratio": cache.kept_ratio(),
        "cache_bytes": cache.nbytes(),
        "full_bytes": cache.full_nbytes(),
        "compaction_s": cache.stats["observe_s"] + cache.stats["compact_s"],
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
    ref = runner.generate(sample.needle.input_ids, None, config.new_tokens) if wants_gen else None
    ref_ppl = (
        runner.continuation_nll(sample.ppl_context, sample.ppl_continuation, None)
        if "ppl" in config.tasks
        else None
    )
    passkey = sample.needle.target.passkey
    sample.reference = None if ref is None else ref["tokens"]
    if ref is not None and "needle" in config.tasks:
        rows.append(
            {
                **base,
                "task": "needle",
                "policy": "full",
                "budget": 1.0,
                "accuracy": tasks.score_needle(ref["text"], passkey),
                "kept_ratio": 1.0,
                "answer": ref["text"],
                "generate_s": ref["seconds"],
            }
        )
    if ref_ppl is not None:
        rows.append(
            {
                **base,
                "task": "ppl",
                "policy": "full",
                "budget": 1.0,
                "kept_ratio": 1.0,
                "ppl": tasks.perplexity(ref_ppl["nll_sum"], ref_ppl["count"]),
                "forward_s": ref_ppl["seconds"],
            }
        )
    for name, budget in configurations(config):
        policy_rows = {**base, "policy": name, "budget": budget}
        if ref is not None:
            got = runner.generate(
                sample.needle.input_ids,
                policy_for(name, budget, sample.context),
                config.new_tokens,
            )
            facts = {
                k: got[k]
                for k in (
                    "kept_ratio",
                    "cache_bytes",
                    "full_bytes",
                    "compaction_s",
                    "decode_compaction_s",
                )
            }
            if "needle" in config.tasks:
                rows.append(
                    {
                        **policy_rows,
                        "task": "needle",
                        "accuracy": tasks.score_needle(got["text"], passkey),
                        "answer": got["text"],
                        "generate_s": got["seconds"],
                        **facts,
                    }
                )
            if "agreement" in config.tasks:
                agree = tasks.agreement(ref["tokens"], got["tokens"])
                rows.append(
                    {
                        **policy_rows,
                        "task": "agreement",
                        "accuracy": agree.token_accuracy,
                        "first_divergence": agree.first_divergence,
                        "n": agree.n,
                        "generate_s": got["seconds"],
                        **facts,
                    }
                )
        if ref_ppl is not None:
            got_ppl = runner.continuation_nll(
                sample.ppl_context,
                sample.ppl_continuation,
                policy_for(name, budget, sample.context),
            )
            rows.append(
                {
                    **policy_rows,
                    "task": "ppl",
                    "ppl": tasks.perplexity(got_ppl["nll_sum"], got_ppl["count"]),
                    "ppl_full": tasks.perplexity(ref_ppl["nll_sum"], ref_ppl["count"]),
                    "kept_ratio": got_ppl["kept_ratio"],
                    "compaction_s": got_ppl["compaction_s"],
                    "forward_s": got_ppl["seconds"],
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
