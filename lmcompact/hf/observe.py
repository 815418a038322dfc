"""What the transformers caches read besides attention: ragged scores, RoPE, token classes.

Prefill scores (window, cumulative, context) come from
:func:`lmcompact.compaction.policy_inputs.prompt_observations`, the builder every engine
shares. Decode: the ragged reference attention returns the mass each kept key got from
the new query, which stands in for the window of one query (TOVA's rule) and accumulates
for H2O; :func:`pad_flat` and :func:`flat_scores_for` move such per-token scores between
the ragged and padded layouts. Token classes (special, punctuation) come from the
prompt's token ids (:class:`TokenClassifier`); :func:`rope_from_model` reads the model's
RoPE.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import torch

from lmcompact.attention.rope import Rope
from lmcompact.layout.ragged import RaggedLayer

_PUNCTUATION = set(string.punctuation) | {"\u2019", "\u201c", "\u201d", "\u2014", "\u2013"}


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
