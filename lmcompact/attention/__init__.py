"""Attention scores from an observation window and reference attention over ragged KV."""

from lmcompact.attention.reference import dense_attention, ragged_attention
from lmcompact.attention.rope import Rope
from lmcompact.attention.scores import (
    context_scores,
    cumulative_scores,
    window_scores,
    window_scores_naive,
)

__all__ = [
    "Rope",
    "context_scores",
    "cumulative_scores",
    "dense_attention",
    "ragged_attention",
    "window_scores",
    "window_scores_naive",
]
