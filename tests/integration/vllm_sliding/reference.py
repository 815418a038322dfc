"""Transformers reference for a compacted model (Gemma-3 with sliding windows, or Llama).

Runs the same model in float32 with eager attention, with one mask per
(layer, kv head) built from *logical* positions::

    query q, key k visible  <=>  k <= q                                  (causal)
                            and  q - k < window          (sliding-window layers only)
                            and  (q < from_query or k >= span or k in kept[layer][head])

``kept`` are the logical positions the engine kept of the compacted span ``[0, span)``;
queries before ``from_query`` (the prompt rows that were computed before the compaction)
see the whole span. Several compactions apply one after the other (a two-stage load: the
loaded selection, then the pack at the prompt's end), each with its own ``(span,
from_query, kept)``. The window comes from the model (each attention module's own
``sliding_window``), so this is the attention a correct engine must compute.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

IMPLEMENTATION = "lmcompact_masked_reference"


@dataclass(frozen=True)
class Compaction:
    """What the engine kept.

    Attributes:
        span: keys ``[0, span)`` were compacted.
        from_query: queries at positions ``>= from_query`` see only the kept keys of the span.
        kept: ``kept[layer][kv_head]``: kept logical positions in ``[0, span)``.
    """

    span: int
    from_query: int
    kept: Sequence[Sequence[torch.Tensor]]


def visible(
    q_pos: torch.Tensor,
    k_len: int,
    window: int | None,
    kept: torch.Tensor | None,
    c: Compaction | None,
) -> torch.Tensor:
    """``(Lq, Lk)`` bool: which keys each query attends to (see the module docstring)."""
    k_pos = torch.arange(k_len)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    if kept is not None and c is not None:
        in_span_kept = torch.ones(k_len, dtype=torch.bool)
        in_span_kept[: c.span] = False
        in_span_kept[kept] = True
        late = q_pos >= c.from_query
        allowed[late] &= in_span_kept[None, :]
    return allowed


class _State:
    stages: tuple[Compaction, ...] = ()


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with the per-(layer, head) logical mask; ``attention_mask`` ignored."""
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    q_len, k_len = query.shape[2], key.shape[2]
    q_pos = torch.arange(k_len - q_len, k_len)  # queries are the last rows (see greedy)
    window = getattr(module, "sliding_window", None)  # Llama-style models have none
    hq, hkv = query.shape[1], key.shape[1]
    masks = []
    for head in range(hkv):
        allowed = visible(q_pos, k_len, window, None, None)
        for c in _State.stages:
            kept = torch.as_tensor(c.kept[module.layer_idx][head])
            allowed &= visible(q_pos, k_len, None, kept, c)
        masks.append(allowed)
    allowed = torch.stack(masks).repeat_interleave(hq // hkv, dim=0)[None]  # (1, Hq, Lq, Lk)
    additive = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill(~allowed, float("-inf"))
    return eager_attention_forward(
        module, query, key, value, additive, dropout=dropout, scaling=scaling, softcap=softcap
    )


def load(model_dir: str) -> Any:
    """The model in float32 with the reference attention registered."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=IMPLEMENTATION
    ).eval()


Stages = Compaction | Sequence[Compaction] | None
"""No compaction, one, or several applied in order."""


@contextmanager
def compacted(c: Stages) -> Iterator[None]:
    _State.stages = () if c is None else (c,) if isinstance(c, Compaction) else tuple(c)
    try:
        yield
    finally:
        _State.stages = ()


def greedy(
    model: Any, prompt: Sequence[int], new_tokens: int, c: Stages
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities.

    The cache is a plain ``DynamicCache`` (every layer keeps every key, no window trimming),
    so each call's keys are the whole sequence and its queries the last rows.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    step = torch.tensor([list(prompt)])
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad(), compacted(c):
        for _ in range(new_tokens):
            out = model(step, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            tokens.append(token)
            step = torch.tensor([[token]])
    return tokens, logprobs


def engine_greedy(
    llm: Any, prompt: Sequence[int], new_tokens: int
) -> tuple[list[int], list[float]]:
    """The engine's greedy tokens for ``prompt`` and their log-probabilities (what
    :func:`greedy` returns for the reference)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    return tokens, [float(step[t].logprob) for t, step in zip(tokens, out.logprobs, strict=True)]


def assert_engine_matches(
    model: Any,
    prompt: Sequence[int],
    engine: tuple[list[int], list[float]],
    compaction: Compaction,
    atol: float,
) -> float:
    """The engine's greedy ``(tokens, log-probabilities)`` equal :func:`greedy` over
    ``compaction`` (log-probabilities within ``atol``), and the full cache's answer differs
    (so the comparison can tell kept sets apart); returns the largest log-probability gap."""
    tokens, logprobs = engine
    ref_tokens, ref_logprobs = greedy(model, prompt, len(tokens), compaction)
    gap = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True))
    print(f"engine {tokens}\nreference {ref_tokens}\nmax log-probability gap {gap:.2e}")
    assert tokens == ref_tokens
    assert gap < atol, f"log-probabilities differ by up to {gap:.2e}"
    full_tokens, full_logprobs = greedy(model, prompt, len(tokens), None)
    assert (
        full_tokens != tokens
        or max(abs(a - b) for a, b in zip(full_logprobs, logprobs, strict=True)) > 10 * atol
    )
    return gap


def stored_positions(chunks: Sequence[Any], chunk_size: int) -> list[list[torch.Tensor]]:
    """``kept[layer][head]``: the logical positions loaded chunks ``0, 1, ..`` (from token
    0) hold for each (layer, kv head), per-head counts or not."""
    layers, heads = chunks[0].kept_counts.shape

    def one(layer: int, head: int) -> torch.Tensor:
        rows = [c.head(layer, head)[2].long() + i * chunk_size for i, c in enumerate(chunks)]
        return torch.cat(rows)

    return [[one(layer, head) for head in range(heads)] for layer in range(layers)]
