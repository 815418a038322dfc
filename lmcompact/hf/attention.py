"""The ``"lmcompact"`` attention implementation for transformers models.

transformers looks attention functions up by ``config._attn_implementation`` in
its ``AttentionInterface``. lmcompact registers one function there; a model uses
it after :func:`enable_lmcompact_attention` (or ``from_pretrained(...,
attn_implementation="lmcompact")`` once :func:`register_attention` ran).

How the function finds the cache without globals: the cache's ``update()``
returns its key tensor *tagged* with what attends for that layer (a Python
attribute on a fresh view, see :data:`TAG`): the layer itself
(:class:`~lmcompact.hf.paged.PagedCache`), or the cache's attention for the layer
(:class:`~lmcompact.hf.cache.CompactingCache`, which observes the prefill and
compacts after the last layer). The model's attention module passes that tensor
straight to the attention function, which hands the call over (prefill: SDPA over
the full prompt; after compaction: ragged or paged per-head attention). Untagged
keys (a plain ``DynamicCache`` or no cache) get ordinary causal SDPA, so a model
switched to ``"lmcompact"`` still works with any other cache.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "lmcompact"
TAG = "_lmcompact_layer"


class AttendingLayer(Protocol):
    """What a tagged key tensor points at (a cache layer, or a cache's attention for one)."""

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Return the attention output ``(B, S, Hq, D)``."""
        ...


def tag(tensor: torch.Tensor, layer: AttendingLayer) -> torch.Tensor:
    """A view of ``tensor`` carrying ``layer`` (what attends) for the attention function."""
    view = tensor.view_as(tensor)
    setattr(view, TAG, layer)
    return view


def causal_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    **kwargs: Any,
) -> torch.Tensor:
    """Causal SDPA with the causal diagonal aligned bottom-right; output ``(B, S, Hq, D)``.

    A sliding-window layer (transformers passes ``sliding_window=W``) sees only keys less
    than ``W`` positions behind each query, as transformers' own masks do.

    Args:
        query: ``(B, Hq, S, D)``; key, value: ``(B, Hkv, T, D)`` with ``T >= S``.
    """
    s, t = query.shape[2], key.shape[2]
    window = kwargs.pop("sliding_window", None)
    mask = None
    if (s > 1 and s != t) or (window is not None and t > window):
        query_at = torch.arange(t - s, t, device=query.device)[:, None]
        key_at = torch.arange(t, device=query.device)[None, :]
        visible = key_at <= query_at
        if window is not None:
            visible &= key_at > query_at - int(window)
        mask = visible[None, None]
    out, _ = sdpa_attention_forward(
        module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs
    )
    return out


def lmcompact_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: dispatch to the lmcompact cache layer, else SDPA.

    Args:
        module: The model's attention module (reads ``layer_idx``, GQA groups).
        query: ``(B, Hq, S, D)`` post-RoPE queries.
        key: ``(B, Hkv, T, D)`` as returned by the cache's ``update``.
        value: ``(B, Hkv, T, D)``.
        attention_mask: Ignored: transformers builds none for a custom
            implementation; batches must be unpadded.
        scaling: Softmax scale.

    Returns:
        ``(B, S, Hq, D)`` output and None (no attention weights).
    """
    if dropout:
        raise ValueError(f"lmcompact attention is inference-only; got dropout={dropout}")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    layer: AttendingLayer | None = getattr(key, TAG, None)
    if layer is None:
        return causal_sdpa(module, query, key, value, scale, **kwargs), None
    return layer.attend(module, query, key, value, scale, **kwargs), None


def register_attention() -> None:
    """Register ``"lmcompact"`` in transformers' AttentionInterface (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, lmcompact_attention_forward)


def enable_lmcompact_attention(model: Any) -> Any:
    """Register the implementation and switch ``model`` to it; returns the model."""
    register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    logger.debug("model %s now uses %s attention", type(model).__name__, ATTN_IMPLEMENTATION)
    return model
