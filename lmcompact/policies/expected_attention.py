"""Expected Attention: score keys by the attention future queries are expected to pay."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from lmcompact.plan import KeepPlan
from lmcompact.policies._select import pool_scores
from lmcompact.policies.allocation import global_keep_plan
from lmcompact.policies.base import CompactionInputs, Need, Phase, ScorePolicy
from lmcompact.policies.kvzip import sample_query_positions

logger = logging.getLogger(__name__)

QUERY_SOURCES = ("prompt", "window")
SAMPLE_TAIL = 32
"""Last prompt positions always in the ``"prompt"`` sample (KVzip's default tail, so the
transformers eval's recorded sample serves both policies)."""

_unrotated_logged = False


def _log_unrotated() -> None:
    global _unrotated_logged
    _unrotated_logged = True
    logger.info(
        "expected_attention: no RoPE facts from the integration; the queries' "
        "statistics are used without rotating them to future positions"
    )


@dataclass
class ExpectedAttention(ScorePolicy):
    """Keep the keys with the highest expected attention from future queries.

    Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention
    from Future Queries Distribution", https://arxiv.org/abs/2510.00636. Future
    queries are modelled per query head as a Gaussian ``q ~ N(mu, Sigma)`` estimated
    from prompt queries; then ``E[exp(scale q.k)] = exp(scale mu.k
    + scale^2 k^T Sigma k / 2)``, normalized over the keys (a softmax), averaged over
    the query heads of each KV group and multiplied by ``||v||`` (plus ``epsilon``).

    Position: queries are post-RoPE. With ``inputs.rope`` each window query is turned
    back to its pre-RoPE vector (``R(-p) q``), the statistics are taken there, and the
    mean and covariance are rotated by the rotation averaged over the next
    ``n_future_positions`` positions after the window (``M = mean_d R(p_end + d)``:
    ``mu' = M mu``, ``Sigma' = M Sigma M^T``), as the paper does. Without a rope the
    post-RoPE statistics are used as they are (logged once).

    Which queries: with ``queries="prompt"`` (default, as the paper and kvpress, which
    take every context query) a sample across the whole prompt (:meth:`context_queries`:
    every position up to ``max_queries``, else evenly spaced ones plus the last 32) next to
    the observation window; the integration captures them where the prefill computes
    them (the vLLM worker copies them with the window; transformers slices them from the
    prefill's queries). The first ``n_sink`` positions are left out of the statistics
    (their queries are outliers). With ``queries="window"`` only the observation window
    (the prompt's last ``window`` queries): on a stored prefix that is the end of the
    context, a narrow estimate of what later questions ask. Cost of ``"prompt"``: the
    captured queries, ``S x Hq x D`` floats per layer (S <= ``max_queries``; 70 MiB for
    SmolLM2's 30 layers at 1024), and ``O(S Hq D^2)`` for the covariance; no attention.

    Shapes: window_queries ``(Hq, W, D)``, query_positions ``(W,)``, keys / values
    ``(H, T, D)`` -> scores ``(H, T)``; the first ``n_sink`` positions score +inf.
    Needs no attention over the prompt. The softmax runs over every non-sink key it is
    given (``span_scores``: the vLLM save path scores the whole saved span at once and
    plans each chunk from its slice, so a chunk's ranking is the whole context's, as in
    the paper's code, where the group mean weighs each query head by its softmax over all
    keys).

    Attributes:
        n_future_positions: Future positions the rotation is averaged over.
        n_sink: Initial positions always kept (outliers the Gaussian does not model).
        use_covariance: Include the ``k^T Sigma k`` term.
        use_vnorm: Multiply by the value norm.
        epsilon: Added to the normalized scores before the value-norm product.
        queries: Where the statistics come from: ``"prompt"`` or ``"window"``.
        max_queries: Most prompt queries sampled with ``"prompt"`` (>= 32).
        kernel_size: Max-pool width of the scores along the sequence, odd (1: none).
        share: One token set for every (layer, head): the tokens that a global top-k
            over every (layer, head, token) picks in the most heads
            (:func:`lmcompact.policies.allocation.global_keep_mask`); per-head choices
            keep one digit of a number here and another there.
    """

    name = "expected_attention"
    needs = Need.KEYS | Need.WINDOW_QUERIES
    phases = Phase.PREFILL
    span_scores = True

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    queries: str = "prompt"
    max_queries: int = 1024
    kernel_size: int = 1
    share: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_future_positions < 1:
            raise ValueError(f"n_future_positions must be >= 1, got {self.n_future_positions}")
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")
        if self.queries not in QUERY_SOURCES:
            raise ValueError(
                f"queries must be one of {', '.join(QUERY_SOURCES)}, got {self.queries!r}"
            )
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {self.kernel_size}")
        if self.max_queries < SAMPLE_TAIL:
            raise ValueError(f"max_queries must be >= {SAMPLE_TAIL}, got {self.max_queries}")

    def context_queries(self, length: int) -> torch.Tensor | None:
        """``(S,)`` prompt positions whose queries make the statistics (besides the
        window); None with ``queries="window"``."""
        if self.queries == "window":
            return None
        return sample_query_positions(length, self.max_queries, SAMPLE_TAIL)

    def query_statistics(
        self, queries: torch.Tensor, inputs: CompactionInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean ``(Hq, D)`` and covariance ``(Hq, D, D)`` of the future queries (float64).

        ``queries`` ``(Hq, W, D)`` at ``inputs.query_positions``; those before ``n_sink``
        are left out (unless no other is given).
        """
        q = queries.detach().double()
        positions = inputs.query_positions
        assert positions is not None  # check_inputs ran
        late = positions >= self.n_sink
        if bool(late.any()) and not bool(late.all()):
            q, positions = q[:, late.to(q.device)], positions[late]
        rope = inputs.rope
        if rope is not None:
            q = rope.rotate(q, -positions.to(q.device).double())
        elif not _unrotated_logged:
            _log_unrotated()
        mu = q.mean(dim=1)
        cov = None
        if self.use_covariance:
            centered = q - mu.unsqueeze(1)
            cov = centered.transpose(1, 2) @ centered / q.shape[1]
        if rope is not None:
            first = float(positions.max()) + 1.0
            future = first + torch.arange(self.n_future_positions, dtype=torch.float64)
            m = rope.mean_rotation(future, q.shape[-1]).to(q.device)
            mu = mu @ m.T
            if cov is not None:
                cov = m @ cov @ m.T
        return mu, cov

    def score(self, inputs: CompactionInputs, layer: int) -> torch.Tensor:
        obs = inputs.layers[layer]
        assert obs.keys is not None and obs.window_queries is not None  # check_inputs ran
        keys = obs.keys.detach().double()
        h, t, d = keys.shape
        group = obs.window_queries.shape[0] // h
        mu, cov = self.query_statistics(obs.window_queries.to(keys.device), inputs)
        scale = inputs.attention_scale or 1.0 / math.sqrt(d)
        k = keys.repeat_interleave(group, dim=0)  # (Hq, T, D)
        logits = scale * torch.einsum("htd,hd->ht", k, mu)
        if cov is not None:
            logits = logits + scale**2 / 2 * ((k @ cov) * k).sum(dim=-1)
        valid = inputs.valid_or_all().to(keys.device)
        sinks = (inputs.positions_or_arange() < self.n_sink).to(keys.device)
        # the sinks (kept anyway) stay out of the softmax, as in the paper's code
        late = valid & ~sinks
        normalized = late if bool(late.any(dim=-1).all()) else valid
        normalized = normalized.repeat_interleave(group, dim=0)
        probs = torch.softmax(logits.masked_fill(~normalized, float("-inf")), dim=-1)
        scores = probs.view(h, group, t).mean(dim=1)
        if self.use_vnorm:
            assert obs.values is not None
            scores = (scores + self.epsilon) * torch.linalg.vector_norm(
                obs.values.detach().double(), dim=-1
            )
        if self.kernel_size > 1:
            raw = scores.masked_fill(~valid, 0.0)
            scores = pool_scores(raw, self.kernel_size, "maxpool") + raw * 1e-6
        return scores.masked_fill(sinks & valid, float("inf"))

    def plan_scored(self, inputs: CompactionInputs, scores: list[torch.Tensor]) -> KeepPlan:
        if not self.share:
            return super().plan_scored(inputs, scores)
        return global_keep_plan(scores, self.keep_count(inputs), inputs.valid, share=True)
