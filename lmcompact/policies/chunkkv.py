"""ChunkKV: keep whole runs of consecutive tokens, ranked by the window's attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies.base import CompactionInputs, Need, Phase
from lmcompact.policies.window_scored import WindowScoredPolicy


@dataclass
class ChunkKV(WindowScoredPolicy):
    """Keep the observation window plus whole chunks of tokens the window attends to most.

    A chunk is ``chunk_size`` consecutive tokens; every head of a layer keeps the same ones.

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

    chunk_size: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        mass, window = self.window_mass(inputs, layer)
        # mass per original position, over the layer's heads (padded decode candidates
        # keep their positions), then per chunk of positions: one ranking for every head
        device = mass.device
        position = inputs.positions_or_arange().to(device).long()
        span = int(position.max()) + 1 if position.numel() else 0
        per_position = torch.zeros(span, dtype=torch.float64, device=device)
        per_position.index_add_(0, position.reshape(-1), mass.reshape(-1))
        per_chunk = torch.zeros(-(-span // self.chunk_size), dtype=torch.float64, device=device)
        chunk_of = torch.arange(span, device=device) // self.chunk_size
        per_chunk.index_add_(0, chunk_of, per_position)
        scale = per_chunk.abs().max().clamp(min=1e-30) if span else torch.tensor(1.0)
        # the token's own mass orders the budget's last, partial chunk; far below a chunk's
        tie_break = per_position[position] / scale * 1e-9
        return (per_chunk[position // self.chunk_size] + tie_break).masked_fill(
            window, float("inf")
        )
