"""Tokens forced into a vLLM request's output: teacher forcing through a real engine.

vLLM takes no tokens in the middle of a request, so a long generation cannot be replayed by
feeding it as a prompt (that would be a prefill, which decode-time compaction never sees).
:class:`ForcedTokens` is a logits processor that makes a request's first output tokens the
ones listed in its ``SamplingParams.extra_args["lmcompact_forced"]``; after them the request
decodes freely. The engine decodes them one step at a time, so the connector's decode budget
compacts the sequence exactly as it would for the model's own tokens.

vLLM computes the log-probabilities it returns from the raw logits, before logits
processors (``logprobs_mode`` "raw_logprobs", the default), so with ``logprobs=1`` each forced
step also reports what the model itself would have predicted there and the log-probability
it gave the forced token: teacher-forced agreement and log-probability gap.

Load with ``LLM(..., logits_processors=[ForcedTokens])``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCED_KEY = "lmcompact_forced"


class ForcedTokens(AdapterLogitsProcessor):  # type: ignore[misc]
    """Forces each request's first output tokens (``extra_args[FORCED_KEY]``)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(
        self, params: Any
    ) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        forced = (params.extra_args or {}).get(FORCED_KEY)
        if not forced:
            return None
        tokens = [int(t) for t in forced]

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step < len(tokens):
                chosen = logits[tokens[step]].clone()
                logits.fill_(float("-inf"))
                logits[tokens[step]] = chosen
            return logits

        return force


def forced_params(forced: Sequence[int], free_tokens: int, logprobs: int | None = 1) -> Any:
    """Greedy ``SamplingParams`` forcing ``forced`` then decoding ``free_tokens`` more."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=len(forced) + free_tokens,
        min_tokens=len(forced),
        logprobs=logprobs,
        detokenize=False,
        extra_args={FORCED_KEY: list(forced)},
    )


def step_predictions(output: Any, forced: Sequence[int]) -> tuple[list[int], list[float]]:
    """Per forced step: the model's own top-1 token and its log-probability of the forced
    token (raw, before forcing), from a completion made with :func:`forced_params`."""
    top1, logprobs = [], []
    for token, step in zip(forced, output.logprobs[: len(forced)], strict=True):
        top1.append(next(t for t, lp in step.items() if lp.rank == 1))
        logprobs.append(float(step[token].logprob))
    return top1, logprobs
