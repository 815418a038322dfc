"""R-KV: keep tokens that are attended to and not redundant with other kept keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.policies._select import pool_scores, recent_mask
from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy


@dataclass
class RKV(ScorePolicy):
    """Redundancy-aware compression for long generations (reasoning traces).

    Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models",
    https://arxiv.org/abs/2505.24133. Per (layer, kv head), a candidate's score is::

        score = mix_lambda * importance - (1 - mix_lambda) * redundancy

    * importance: the mean attention of the last ``window_size`` queries, max-pooled along
      the sequence (width ``kernel_size``);
    * redundancy: with ``S`` the cosine similarity between candidate keys (diagonal 0), each
      row ``i`` forgets its most recent neighbour with ``S > similarity_threshold`` (so the
      latest of near-duplicates looks less redundant and survives), then
      ``redundancy = softmax_j(mean_i S[i, j])`` over the valid candidates.

    The window's own candidates (the ``window_size`` most recent valid ones) are kept.
    Where the authors pool GQA logits by max before the softmax, the integrations here give
    softmax rows averaged over the query heads of a group.

    Shapes: keys ``(H, T, D)``, window_attention ``(H, W, T)`` -> scores ``(H, T)``.

    Attributes:
        window_size: Observation window (the authors' code: 8).
        kernel_size: Pooling width of the importance, odd (7).
        mix_lambda: Weight of the importance against the redundancy, in [0, 1] (the
            authors' code: 0.07).
        similarity_threshold: Cosine similarity above which two keys are near-duplicates
            (0.5).
        interval: Generated tokens between two re-compactions in the transformers cache
            (the vLLM connector re-compacts whenever a block leaves its decode budget).
    """

    name = "rkv"
    needs = Need.KEYS | Need.WINDOW_ATTENTION
    phases = Phase.BOTH

    window_size: int = 8
    kernel_size: int = 7
    mix_lambda: float = 0.07
    similarity_threshold: float = 0.5
    interval: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {self.kernel_size}")
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda must be in [0, 1], got {self.mix_lambda}")
        if not -1.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(
                f"similarity_threshold must be in [-1, 1], got {self.similarity_threshold}"
            )
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")

    def window_mask(self, inputs: CompactionInputs) -> torch.Tensor:
        """``(H, T)`` bool: the observation window (the most recent valid candidates)."""
        kept = inputs.valid_counts().clamp(max=self.keep_count(inputs))
        return recent_mask(inputs, kept.clamp(max=self.window_size)).cpu()

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        observed = inputs.layers[layer]
        rows, keys = observed.window_attention, observed.keys
        assert rows is not None and keys is not None  # check_inputs ran
        valid = inputs.valid_or_all().cpu()
        window = self.window_mask(inputs)
        attention = rows[:, -self.window_size :].detach().double().cpu().mean(dim=1)
        attention = attention.masked_fill(window | ~valid, 0.0)
        importance = pool_scores(attention, self.kernel_size, "maxpool")
        positions = inputs.positions_or_arange().cpu()
        redundancy = key_redundancy(
            keys.detach().cpu(), positions, valid, self.similarity_threshold
        )
        scores = self.mix_lambda * importance - (1.0 - self.mix_lambda) * redundancy
        return scores.masked_fill(window, float("inf"))


def key_redundancy(
    keys: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, threshold: float
) -> torch.Tensor:
    """``(H, T)`` float64 redundancy of each valid key among the valid keys of its head.

    Args:
        keys: ``(H, T, D)``.
        positions: ``(H, T)`` original positions (which neighbour is the most recent).
        valid: ``(H, T)`` bool.
        threshold: cosine similarity above which keys are near-duplicates.
    """
    unit = keys.double() / keys.double().norm(dim=-1, keepdim=True).clamp(min=1e-8)
    sim = unit @ unit.transpose(-1, -2)  # (H, T, T)
    pair = valid[:, :, None] & valid[:, None, :]
    sim = sim.masked_fill(~pair, 0.0)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    similar = sim > threshold
    recency = positions.double()[:, None, :].expand_as(sim).masked_fill(~similar, -1.0)
    latest = recency.argmax(dim=-1, keepdim=True)  # (H, T, 1) most recent near-duplicate
    has = similar.any(dim=-1, keepdim=True)
    sim = sim.scatter(-1, latest, torch.where(has, 0.0, sim.gather(-1, latest)))
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1).double()  # rows averaged: valid ones
    mean = sim.sum(dim=-2) / count
    return torch.softmax(mean.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)
