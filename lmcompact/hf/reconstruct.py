"""KVzip's context-reconstruction scores in transformers (the reference for the vLLM path).

One forward pass reads ``context + repeat prompt + context`` (:func:`reconstruction_ids`);
inside every attention layer the queries of the second copy are scored against the keys
of the first with :func:`lmcompact.attention.scores.reconstruction_scores` (each key: the
largest softmax weight any repeat query of its GQA group gives it), layer by layer, so
only ``(Hkv, T)`` scores per layer are kept, never the queries. The first ``T`` positions
of that pass are exactly a prefill of the context alone (causal attention), so its cache,
cropped to ``T``, is the context's KV::

    ids        [ context (T) | repeat prompt (r) | context again (T) ]
    keys        0 ........ T-1                                   2T+r-1
    queries                                     [ T+r ...... 2T+r-1 ] -> scores (Hkv, T)

The pass runs the decoder without the LM head (a ``(2T + r, vocab)`` logits tensor is
4 GiB for Gemma-3 at 2k); the head is applied to the first copy only, chunk by chunk, for
each context token's surprisal ``-log p(token | prefix)`` (:attr:`Reconstruction.surprisal`).
The cache holds every layer whole (no sliding-window cache layers), so sliding-window
models crop correctly; their masks still apply each layer's window by logical position.
Scores of sliding-window layers are computed like the others but mean little: their
repeat queries cannot see the first copy (:attr:`Reconstruction.sliding` names them).

The vLLM connector computes the same scores from the same positions of a real engine
request (``connectors/vllm/reconstruct.py``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lmcompact.attention.scores import reconstruction_scores
from lmcompact.policies.kvzip import reconstruction_ids

logger = logging.getLogger(__name__)

LayerHook = Callable[[int, torch.Tensor, torch.Tensor], None]
"""``(layer, queries (B, Hq, S, D), keys (B, Hkv, S, D))``, post-RoPE, after attention."""


@dataclass
class Reconstruction:
    """Result of one reconstruction pass.

    Attributes:
        scores: ``(L, Hkv, T)`` float32 per-key scores of the context.
        cache: The context's KV (the pass's cache cropped to ``T``), every layer whole.
        context_len: ``T``.
        surprisal: ``(T,)`` float32 ``-log p(context[i] | context[:i])`` (0 at i = 0).
        sliding: indices of the model's sliding-window layers (``config.layer_types``).
    """

    scores: torch.Tensor
    cache: DynamicCache
    context_len: int
    surprisal: torch.Tensor
    sliding: tuple[int, ...] = ()


def sliding_layers(config: Any) -> tuple[int, ...]:
    """Indices of the sliding-window layers a transformers config declares (none: ``()``)."""
    types = getattr(config, "layer_types", None) or ()
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


@torch.no_grad()
def surprisal(model: Any, hidden: torch.Tensor, ids: list[int], chunk: int = 256) -> torch.Tensor:
    """``(T,)`` ``-log p(ids[i] | ids[:i])`` from the decoder's ``(T, hidden)`` last states.

    The LM head runs on ``chunk`` positions at a time; position 0 gets 0.
    """
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    target = torch.tensor(ids[1:])
    out = torch.zeros(len(ids))
    for lo in range(0, len(ids) - 1, chunk):
        hi = min(lo + chunk, len(ids) - 1)
        logits = head(hidden[lo:hi]).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        logp = torch.log_softmax(logits, dim=-1)
        out[lo + 1 : hi + 1] = -logp.gather(1, target[lo:hi, None])[:, 0]
    return out


@torch.no_grad()
def reconstruct(
    model: Any,
    context_ids: list[int],
    repeat_ids: list[int],
    on_layer: LayerHook | None = None,
    query_chunk: int = 128,
) -> Reconstruction:
    """Run the reconstruction pass of ``context_ids`` and score the context's keys.

    Args:
        model: A transformers causal LM (batch of one).
        context_ids: The context, ``T`` token ids.
        repeat_ids: The instruction between the copies (:data:`REPEAT_PROMPT` tokenized).
        on_layer: Optional extra observer of each layer's post-RoPE queries and keys.
        query_chunk: Repeat queries scored per block (memory ``Hq x chunk x 2T``).
    """
    ids = reconstruction_ids(context_ids, repeat_ids)
    t = len(context_ids)
    first = t + len(repeat_ids)
    positions = torch.arange(first, len(ids))
    scores: dict[int, torch.Tensor] = {}

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        layer = int(getattr(module, "layer_idx"))  # noqa: B009 (an int attribute, untyped)
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        scores[layer] = reconstruction_scores(
            query[:, :, first:],
            key,
            positions,
            t,
            scale=scale,
            query_chunk=query_chunk,
        )[0]
        if on_layer is not None:
            on_layer(layer, query, key)
        return out, None

    name = f"lmcompact_reconstruct_{uuid.uuid4().hex[:8]}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        cache = DynamicCache()  # every layer whole: a sliding-window layer must crop too
        hidden = model.get_decoder()(
            input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True
        ).last_hidden_state[0, :t]
    finally:
        model.set_attn_implementation(previous)
    cache.crop(t - len(ids))  # drop the repeat and the second copy
    stacked = torch.stack([scores[i] for i in sorted(scores)])
    logger.debug("reconstruction pass over %d tokens scored %d layers", len(ids), len(scores))
    return Reconstruction(
        scores=stacked,
        cache=cache,
        context_len=t,
        surprisal=surprisal(model, hidden, list(context_ids)),
        sliding=sliding_layers(model.config),
    )
