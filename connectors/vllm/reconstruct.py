"""KVzip's reconstruction pass as a real vLLM request (the save path of ``kvzip``).

A reconstruction request's prompt is ``context + repeat prompt + context``
(:func:`lmcompact.policies.kvzip.reconstruction_ids`, :data:`REPEAT_PROMPT`) and its
``kv_transfer_params`` carry ``{"lmcompact": {"reconstruct": {"context_len": T,
"copy_start": T + r}}}``
(:func:`store_context` builds both). The connector then, for that request only:

- loads nothing from the store (the pass computes the whole prompt itself);
- scores, inside every attention layer as the engine computes it, the second copy's
  queries against the request's keys (:func:`lmcompact.attention.scores.reconstruction_scores`:
  the largest softmax weight any query of a GQA group gives each key of the first copy),
  keeping only ``(Hkv, T)`` running maxima per layer (:class:`ReconstructScores`), never
  the queries; a chunked prefill scores each step's queries as they come;
- stores the FIRST copy's whole chunks, compacted with those scores, under the keys a
  later ``context + question`` request looks up (chunk keys hash the token ids from the
  prompt start, and the first copy is a prefix of both); the repeat and the second copy
  are never stored::

      prompt  [ context: chunks 0..T/C-1 | repeat | context again ]
      saved     ^^^^^^^^^^^^^^^^^^^^^^^^^
      scored by  queries of ------------------->  [ ........... ]

Cost: the stored context is prefilled twice plus the repeat prompt (once per context), and
each layer's scoring reads the request's keys and computes ``T x N`` weights per query
head (``N`` up to ``2T + r``), as much work again as that layer's attention in torch.

Scores given with the request (``self_info``): :func:`store_surprisal_context` first runs
the context once with ``prompt_logprobs`` under ``{"lmcompact": {"save": false}}`` (the
connector neither loads nor stores that request), turns the logprobs into surprisal, and
then stores the context with ``{"lmcompact": {"token_scores": [T floats]}}``: the
connector compacts its chunks with those scores as every layer's and head's context
scores. Cost: two prefills of the context, no scoring inside attention.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcompact.attention.scores import reconstruction_scores
from lmcompact.policies.kvzip import REPEAT_PROMPT, reconstruction_ids

logger = logging.getLogger(__name__)

PARAMS_KEY = "lmcompact"
"""Our entry of a request's ``kv_transfer_params``."""

__all__ = [
    "PARAMS_KEY",
    "REPEAT_PROMPT",
    "ReconstructRequest",
    "ReconstructScores",
    "reconstruct_params",
    "reconstruct_request",
    "save_allowed",
    "store_context",
    "store_surprisal_context",
    "token_scores",
]


@dataclass(frozen=True)
class ReconstructRequest:
    """Where a reconstruction request's parts sit in its prompt.

    Attributes:
        context_len: ``T``: the first copy (stored) is ``prompt[:T]``.
        copy_start: first position of the repeated copy; its queries score the first copy.
            The copy is ``prompt[copy_start:]``, a prefix of the context (the whole context
            unless the prompt had to fit a position limit).
    """

    context_len: int
    copy_start: int


def reconstruct_params(context_len: int, copy_start: int | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` marking a reconstruction request of a ``context_len`` context
    whose repeated copy starts at ``copy_start`` (None: the prompt ends with the whole
    context)."""
    if context_len <= 0:
        raise ValueError(f"context_len must be > 0, got {context_len}")
    spec: dict[str, int] = {"context_len": int(context_len)}
    if copy_start is not None:
        spec["copy_start"] = int(copy_start)
    return {PARAMS_KEY: {"reconstruct": spec}}


def reconstruct_request(
    params: Mapping[str, Any] | None, prompt: Sequence[int]
) -> ReconstructRequest | None:
    """The parts of a reconstruction request, or None for any other request.

    Raises:
        ValueError: the entry is malformed, or the prompt from ``copy_start`` on is not a
            copy of the context's beginning after a non-empty repeat prompt.
    """
    entry = (params or {}).get(PARAMS_KEY)
    if not entry or "reconstruct" not in entry:
        return None
    spec = entry["reconstruct"]
    if (
        not isinstance(spec, Mapping)
        or not isinstance(spec.get("context_len"), int)
        or not isinstance(spec.get("copy_start", 0), int)
    ):
        raise ValueError(
            f"kv_transfer_params[{PARAMS_KEY!r}]['reconstruct'] must be "
            f"{{'context_len': int, 'copy_start': int (optional)}}, got {spec!r}"
        )
    t = int(spec["context_len"])
    start = int(spec.get("copy_start", len(prompt) - t))
    if t <= 0 or start <= t or start >= len(prompt) or len(prompt) - start > t:
        raise ValueError(
            f"reconstruct context_len {t}, copy_start {start} do not fit a prompt of "
            f"{len(prompt)} tokens (context + repeat prompt + a copy of the context)"
        )
    if list(prompt[start:]) != list(prompt[: len(prompt) - start]):
        raise ValueError(
            "a reconstruction prompt must end with a copy of its context from copy_start on"
        )
    return ReconstructRequest(t, start)


def save_allowed(params: Mapping[str, Any] | None) -> bool:
    """False when the request's entry says ``"save": false`` (a scoring request).

    Raises:
        ValueError: ``save`` is there and not a bool.
    """
    entry = (params or {}).get(PARAMS_KEY) or {}
    value = entry.get("save", True)
    if not isinstance(value, bool):
        raise ValueError(
            f"kv_transfer_params[{PARAMS_KEY!r}]['save'] must be a bool, got {value!r}"
        )
    return value


def token_scores(params: Mapping[str, Any] | None, prompt_len: int) -> list[float] | None:
    """The per-token context scores a request carries (``"token_scores"``), or None.

    Raises:
        ValueError: not a list of ``prompt_len`` finite numbers.
    """
    entry = (params or {}).get(PARAMS_KEY) or {}
    scores = entry.get("token_scores")
    if scores is None:
        return None
    if (
        not isinstance(scores, Sequence)
        or len(scores) != prompt_len
        or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in scores)
    ):
        raise ValueError(
            f"kv_transfer_params[{PARAMS_KEY!r}]['token_scores'] must be a list of "
            f"{prompt_len} finite numbers (one per prompt token)"
        )
    return [float(x) for x in scores]


@dataclass
class ReconstructScores:
    """Running per-key maxima of one reconstruction request, layer by layer.

    Attributes:
        context_len: ``T``.
        num_layers: layers of the model.
        scores: per layer ``(Hkv, T)`` float32 running maxima (absent until scored).
        queries: repeat queries scored so far (summed over layers' first visits).
    """

    context_len: int
    num_layers: int
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    queries: int = 0

    def observe(
        self,
        layer: int,
        queries: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        scale: float,
    ) -> None:
        """Fold one step's repeat queries of one layer in.

        Args:
            layer: layer index.
            queries: ``(n, Hq, D)`` post-RoPE queries of second-copy tokens.
            positions: ``(n,)`` their positions (each ``>= context_len``).
            keys: ``(Hkv, N, D)`` the request's keys from position 0, ``N > max(positions)``.
            scale: the layer's softmax scale.
        """
        q = queries.float().permute(1, 0, 2).unsqueeze(0)  # (1, Hq, n, D)
        got = reconstruction_scores(
            q, keys.float().unsqueeze(0), positions, self.context_len, scale=scale
        )[0].cpu()
        old = self.scores.get(layer)
        self.scores[layer] = got if old is None else torch.maximum(old, got)
        if layer == 0:
            self.queries += int(positions.numel())

    def per_layer(self) -> list[torch.Tensor | None]:
        """``(Hkv, T)`` scores per layer; None for layers never scored (sliding ones)."""
        return [self.scores.get(i) for i in range(self.num_layers)]


def store_context(
    llm: Any,
    context_ids: Sequence[int],
    repeat_ids: Sequence[int] | None = None,
    tokenizer: Any = None,
    max_len: int | None = None,
) -> Any:
    """Store ``context_ids`` compacted by KVzip's reconstruction pass (one vLLM request).

    The engine must run ``LMCompactConnector`` with a policy
    that reads context scores (``kvzip``) and ``compact_on: "save"``. Only the whole
    chunks of the context are stored; a later request whose prompt starts with the context
    loads them. ``max_model_len`` must hold ``2 * len(context_ids) + len(repeat_ids) + 1``.

    Args:
        llm: a ``vllm.LLM``.
        context_ids: the context's token ids.
        repeat_ids: token ids between the copies; default :data:`REPEAT_PROMPT` encoded by
            ``tokenizer`` (or by ``llm``'s own tokenizer).
        max_len: most prompt tokens allowed (the model's positions, ``max_model_len``):
            a longer reconstruction prompt repeats only the context's first
            ``max_len - T - r`` tokens (the last keys are then scored by fewer queries).

    Returns:
        vLLM's ``RequestOutput`` (one generated token, discarded).
    """
    from vllm import SamplingParams

    if repeat_ids is None:
        tok = tokenizer if tokenizer is not None else llm.get_tokenizer()
        repeat_ids = list(tok(REPEAT_PROMPT, add_special_tokens=False)["input_ids"])
    t, r = len(context_ids), len(repeat_ids)
    ids = reconstruction_ids(list(context_ids), list(repeat_ids))
    if max_len is not None and len(ids) > max_len:
        if max_len - t - r < 1:
            raise ValueError(f"max_len {max_len} cannot hold a {t}-token context and its repeat")
        ids = ids[:max_len]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        extra_args={"kv_transfer_params": reconstruct_params(t, t + r)},
    )
    return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]


def store_surprisal_context(llm: Any, context_ids: Sequence[int]) -> Any:
    """Store ``context_ids`` compacted by each token's surprisal (two vLLM requests).

    The engine must run the connector with a policy that reads context scores given with
    the request (``self_info``) and ``compact_on: "save"``. The first request reads the
    context's ``prompt_logprobs`` and is neither loaded nor stored (``"save": false``);
    the second stores the context with ``-logprob`` per token as its ``token_scores``.

    Returns:
        vLLM's ``RequestOutput`` of the storing request (one generated token, discarded).
    """
    from vllm import SamplingParams

    from lmcompact.policies.self_info import surprisal_from_logprobs

    ids = list(context_ids)
    probe = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        prompt_logprobs=0,
        extra_args={"kv_transfer_params": {PARAMS_KEY: {"save": False}}},
    )
    out = llm.generate([{"prompt_token_ids": ids}], probe, use_tqdm=False)[0]
    logprobs: list[float | None] = []
    for token, entry in zip(ids, out.prompt_logprobs, strict=True):
        logprobs.append(None if entry is None else float(entry[token].logprob))
    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        extra_args={
            "kv_transfer_params": {PARAMS_KEY: {"token_scores": surprisal_from_logprobs(logprobs)}}
        },
    )
    return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
