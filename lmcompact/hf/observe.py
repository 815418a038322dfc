"""Turn what the attention forward saw into policy inputs.

Prefill: the last ``W`` post-RoPE queries of each layer are scored against the
prompt's keys with :func:`~lmcompact.attention.scores.window_scores` (chunked,
no ``T x T`` matrix); H2O's cumulative mass uses
:func:`~lmcompact.attention.scores.cumulative_scores`. Decode: the ragged
reference attention returns the mass each kept key got from the new query,
which stands in for the window of one query (TOVA's rule) and accumulates for
H2O. Token classes (special, punctuation) come from the prompt's token ids.
"""

from __future__ import annotations

import string
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcompact.attention.rope import Rope
from lmcompact.attention.scores import context_scores, cumulative_scores, window_scores
from lmcompact.layout.ragged import RaggedLayer
from lmcompact.policies.base import Need

_PUNCTUATION = set(string.punctuation) | {"\u2019", "\u201c", "\u201d", "\u2014", "\u2013"}


@dataclass
class PrefillObservation:
    """One layer's scores from the prefill forward (batch-first).

    Attributes:
        window_scores: ``(B, Hkv, T)`` window mass, or None.
        window_attention: ``(B, Hkv, W, T)`` per-query window rows, or None.
        cumulative_scores: ``(B, Hkv, T)`` mass over every prompt query, or None.
        context_scores: ``(B, Hkv, T)`` max softmax weight over the sampled prompt
            queries (KVzip-style), or None.
        window_queries: ``(B, Hq, W, D)`` post-RoPE queries of the window (and of the
            sampled ``context_positions``), or None.
        query_positions: ``(W,)`` prompt positions of ``window_queries`` (sorted), or None.
    """

    window_scores: torch.Tensor | None = None
    window_attention: torch.Tensor | None = None
    cumulative_scores: torch.Tensor | None = None
    context_scores: torch.Tensor | None = None
    window_queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None


def observe_prefill(
    queries: torch.Tensor,
    keys: torch.Tensor,
    needs: Need,
    window: int,
    scale: float,
    timings: dict[str, float] | None = None,
    context_positions: torch.Tensor | None = None,
    context_shift: int | None = None,
    rope: Rope | None = None,
) -> PrefillObservation:
    """Scores a policy asked for, from one layer's prefill queries and keys.

    Args:
        queries: ``(B, Hq, T, D)`` post-RoPE queries of the whole prompt.
        keys: ``(B, Hkv, T, D)`` post-RoPE keys.
        needs: The policy's needs; only these are computed.
        window: Observation window length ``W`` (clipped to ``T``).
        scale: Softmax scale of the model's attention.
        timings: If given, ``observe_window_s``, ``observe_cumulative_s``,
            ``observe_context_s`` and ``observe_s`` are incremented by the seconds spent.
        context_positions: ``(S,)`` positions of the prompt queries that make the
            context scores (the policy's ``context_queries``), when ``needs`` has
            ``CONTEXT_SCORES``: the same sample the vLLM connector captures. With
            ``WINDOW_QUERIES`` their queries join the window's (Expected Attention's
            statistics).
        context_shift: The policy's ``context_shift`` (used when ``rope`` is known,
            else the context scores are causal, as in the connector).
        rope: The model's RoPE, or None.
    """
    timings = timings if timings is not None else {}
    obs = PrefillObservation()
    start = time.perf_counter()
    t = keys.shape[2]
    wants_rows = Need.WINDOW_ATTENTION in needs
    if Need.WINDOW_SCORES in needs or wants_rows:
        w = max(1, min(window, t))
        mass, rows = window_scores(
            queries[:, :, t - w :], keys, scale=scale, return_attention=wants_rows
        )
        obs.window_scores = mass
        obs.window_attention = rows
    if Need.WINDOW_QUERIES in needs:
        rows = torch.arange(t - max(1, min(window, t)), t)
        if context_positions is not None:
            rows = torch.cat([context_positions.cpu(), rows]).unique()
        obs.window_queries = queries[:, :, rows.to(queries.device)]
        obs.query_positions = rows
    middle = time.perf_counter()
    if Need.CUMULATIVE_SCORES in needs:
        obs.cumulative_scores = cumulative_scores(queries, keys, scale=scale)
    after_cumulative = time.perf_counter()
    if Need.CONTEXT_SCORES in needs:
        if context_positions is None:
            raise ValueError("CONTEXT_SCORES needs context_positions (the policy's sample)")
        positions = context_positions.to(queries.device)
        obs.context_scores = context_scores(
            queries[:, :, positions],
            keys,
            positions,
            scale=scale,
            shift=context_shift if rope is not None else None,
            rope=rope,
        )
    end = time.perf_counter()
    for name, seconds in (
        ("observe_window_s", middle - start),
        ("observe_cumulative_s", after_cumulative - middle),
        ("observe_context_s", end - after_cumulative),
        ("observe_s", end - start),
    ):
        timings[name] = timings.get(name, 0.0) + seconds
    return obs


def pad_flat(layer: RaggedLayer, flat: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Lay a per-token ``(N,)`` tensor out like :meth:`RaggedLayer.padded`: ``(B, H, L)``."""
    lengths = layer.lengths()
    b, h = lengths.shape
    width = int(lengths.max()) if lengths.numel() else 0
    seg = layer.segment_ids()
    local = torch.arange(layer.num_tokens, device=flat.device) - layer.cu_seqlens[seg]
    out = torch.full((b * h, width), fill, dtype=flat.dtype, device=flat.device)
    out[seg, local] = flat
    return out.view(b, h, width)


def flat_scores_for(
    cumulative: torch.Tensor, kept: Sequence[Sequence[torch.Tensor]]
) -> torch.Tensor:
    """Ragged-ordered ``(N,)`` scores of the kept tokens from dense ``(B, H, T)`` scores."""
    flat = [idx.reshape(-1).to(torch.int64) for heads in kept for idx in heads]
    if not flat:
        return cumulative.new_zeros(0)
    b, h, t = cumulative.shape
    counts = torch.tensor([idx.numel() for idx in flat], dtype=torch.int64)
    segs = torch.repeat_interleave(torch.arange(len(flat)), counts)
    toks = torch.cat(flat)
    return cumulative.reshape(b * h, t)[
        segs.to(cumulative.device), toks.to(cumulative.device)
    ].float()


def rope_from_model(model: Any) -> Rope | None:
    """The model's RoPE from its rotary module (``inv_freq``, HF neox layout), or None.

    None when the model has no single rotary module with ``inv_freq`` (Gemma-3 keeps one
    per layer type) or when it scales cos / sin (``attention_scaling != 1``, YaRN)."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        return None
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return None
    return Rope(inv_freq=inv_freq.detach().float().cpu(), neox=True)


class TokenClassifier:
    """Special-token and punctuation masks for token ids, cached per id.

    Args:
        tokenizer: A transformers tokenizer (``all_special_ids``, ``decode``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
        self._punct: dict[int, bool] = {}

    def is_punctuation(self, token_id: int) -> bool:
        if token_id not in self._punct:
            text = self.tokenizer.decode([token_id]).strip()
            self._punct[token_id] = bool(text) and all(ch in _PUNCTUATION for ch in text)
        return self._punct[token_id]

    def masks(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(T,)`` special and punctuation masks of one sequence's ids ``(T,)``."""
        values = [int(i) for i in ids.tolist()]
        special = torch.tensor([i in self.special for i in values], dtype=torch.bool)
        punct = torch.tensor([self.is_punctuation(i) for i in values], dtype=torch.bool)
        return special, punct
