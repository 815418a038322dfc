"""ChunkKV: keep whole runs of consecutive tokens, ranked by the window's attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies._select import recent_mask
from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy


@dataclass
class ChunkKV(ScorePolicy):
    """Keep the observation window plus the chunks of ``chunk_size`` consecutive tokens that
    the window attends to most, the same chunks for every head of a layer.

    Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
    Long-Context LLM Inference", https://arxiv.org/abs/2502.00299 (NeurIPS 2025). A token
    ranked alone loses its neighbours: SnapKV keeps the words of a question's label and
    drops a digit of the number beside them when a tokenizer splits numbers digit by digit.
    Here a chunk (positions ``[c * chunk_size, (c + 1) * chunk_size)``) scores the window's
    attention mass over its tokens, summed over the layer's heads (the paper's chunk
    score), and chunks are kept whole in score order; the budget's last, partial chunk
    keeps its tokens of highest mass.

    Shapes: window_scores ``(H, T)`` (mass summed over the window queries, GQA-averaged;
    computed with ``W = window_size``) -> scores ``(H, T)``, equal across heads; the window
    scores +inf. When the budget is at most ``window_size``, only the most recent
    ``budget`` tokens are kept.

    Attributes:
        window_size: Observation window length (as SnapKV's: 32).
        chunk_size: Tokens per chunk (paper: 10).
    """

    name = "chunkkv"
    needs = Need.WINDOW_SCORES
    phases = Phase.PREFILL

    window_size: int = 32
    chunk_size: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size < 0:
            raise ValueError(f"window_size must be >= 0, got {self.window_size}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")

    def window_mask(self, inputs: CompactionInputs) -> torch.Tensor:
        """``(H, T)`` bool: the observation window (the most recent valid candidates)."""
        kept = inputs.valid_counts().clamp(max=self.keep_count(inputs))
        return recent_mask(inputs, kept.clamp(max=self.window_size))

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        scores = inputs.layers[layer].window_scores
        assert scores is not None  # check_inputs ran
        window = self.window_mask(inputs)
        mass = scores.detach().double().cpu().masked_fill(window | ~inputs.valid_or_all(), 0.0)
        # mass per original position, over the layer's heads (padded decode candidates
        # keep their positions), then per chunk of positions: one ranking for every head
        position = inputs.positions_or_arange().cpu().long()
        span = int(position.max()) + 1 if position.numel() else 0
        per_position = torch.zeros(span, dtype=torch.float64)
        per_position.index_add_(0, position.reshape(-1), mass.reshape(-1))
        per_chunk = torch.zeros(-(-span // self.chunk_size), dtype=torch.float64)
        per_chunk.index_add_(0, torch.arange(span) // self.chunk_size, per_position)
        scale = per_chunk.abs().max().clamp(min=1e-30) if span else torch.tensor(1.0)
        # the token's own mass orders the budget's last, partial chunk; far below a chunk's
        tie_break = per_position[position] / scale * 1e-9
        return (per_chunk[position // self.chunk_size] + tie_break).masked_fill(
            window, float("inf")
        )
