"""StreamingLLM: attention sinks plus a window of the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy


@dataclass
class StreamingLLM(ScorePolicy):
    """Keep the first ``n_sink`` tokens and the most recent ones up to the budget.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
    https://arxiv.org/abs/2309.17453. Every (layer, head) keeps the sinks
    (original positions ``< n_sink``) and the ``budget - n_sink`` valid
    candidates with the highest original positions. When the budget is
    smaller than ``n_sink``, the earliest sinks are kept.

    Shapes: positions ``(H, T)`` -> scores ``(H, T)``: the position itself for
    ordinary tokens, and a value above every position for sinks (earlier sinks
    higher). Works on padded decode candidates (``valid``) too.

    Attributes:
        n_sink: Initial tokens always kept (the paper uses 4).
    """

    name = "streaming_llm"
    needs = Need.NOTHING
    phases = Phase.BOTH

    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        positions = inputs.positions_or_arange().to(torch.float64)
        above_all = float(positions.max()) + 1.0
        sink_score = above_all + (self.n_sink - positions)
        return torch.where(positions < self.n_sink, sink_score, positions)
