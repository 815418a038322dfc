"""The one list of policy cases that drives every policy test.

Other suites (the HF eval harness, the vLLM connector) run every policy through
this list::

    from tests.unit.policies.cases import POLICY_CASES

    for case in POLICY_CASES:
        policy = case.make(budget=0.5)
        inputs = case.build(layers=2, heads=2, length=64, head_dim=16)
        plan = policy.plan(inputs)

Each case names a registered policy, its hyper-parameters (small windows so
that short synthetic sequences exercise them) and how its budget is respected
(``budget_rule``). ``build`` makes synthetic :class:`CompactionInputs` carrying
every input any policy reads, computed from random queries and keys with the
real score functions of :mod:`lmcompact.attention.scores`. With
``padded=True`` the inputs look like decode-time candidates: per-head original
positions, trailing padding slots marked invalid, and padding slots baited
with the most attractive values (huge scores, zero keys, position 0) so that a
policy that forgets ``valid`` keeps them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcompact.attention.rope import Rope
from lmcompact.attention.scores import context_scores, cumulative_scores, window_scores
from lmcompact.policies import (
    Budget,
    CompactionInputs,
    CompactionPolicy,
    LayerObservation,
    make_policy,
)

BUDGET_RULES = {
    "all": "every valid candidate is kept (budget ignored)",
    "exact": "every (layer, head) keeps exactly min(k, valid candidates)",
    "layer_total": "each layer keeps min(k * heads, valid) in total; heads differ; "
    "each head keeps at least its safeguard",
    "pyramid": "heads of a layer keep the same count, non-increasing with depth, "
    "layers sum to layers * k (less only if the prompt is too short)",
    "cap": "every (layer, head) keeps at most min(k, valid candidates)",
    "pattern": "retrieval heads keep every valid candidate, streaming heads sinks + recent",
}


@dataclass(frozen=True)
class PolicyCase:
    """One policy configuration to test.

    Attributes:
        id: Test id (unique in :data:`POLICY_CASES`).
        name: Registered policy name.
        params: Hyper-parameters (besides the budget).
        budget_rule: A key of :data:`BUDGET_RULES`.
        window: Observation-window length ``W`` of the synthetic scores.
        shape_params: Extra hyper-parameters that depend on (layers, heads),
            e.g. a DuoAttention head pattern.
    """

    id: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    budget_rule: str = "exact"
    window: int = 4
    shape_params: Callable[[int, int], dict[str, Any]] | None = None

    def make(
        self, budget: Budget | float | int | str | None = None, layers: int = 1, heads: int = 1
    ) -> CompactionPolicy:
        """The policy instance (``layers``/``heads`` matter only with ``shape_params``)."""
        params = dict(self.params)
        if self.shape_params is not None:
            params.update(self.shape_params(layers, heads))
        if budget is not None:
            params["budget"] = budget
        return make_policy(self.name, **params)

    def build(
        self,
        layers: int,
        heads: int,
        length: int,
        head_dim: int,
        *,
        seed: int = 0,
        padded: bool = False,
    ) -> CompactionInputs:
        """Synthetic inputs with everything any policy reads (see the module docstring)."""
        return synthetic_inputs(
            layers, heads, length, head_dim, window=self.window, seed=seed, padded=padded
        )


def _duo_pattern(layers: int, heads: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(layers * 100 + heads)
    return {"head_scores": torch.rand(layers, heads, generator=generator).tolist()}


POLICY_CASES: list[PolicyCase] = [
    PolicyCase("none", "none", budget_rule="all"),
    PolicyCase("random", "random", {"seed": 7}),
    PolicyCase("streaming_llm", "streaming_llm", {"n_sink": 2}),
    PolicyCase("h2o", "h2o", {"recent_ratio": 0.5}),
    PolicyCase("tova", "tova"),
    PolicyCase("snapkv", "snapkv", {"window_size": 4, "kernel_size": 3}),
    PolicyCase(
        "decoding-snapkv", "decoding_snapkv", {"window_size": 4, "kernel_size": 3, "interval": 8}
    ),
    PolicyCase("rkv", "rkv", {"window_size": 4, "kernel_size": 3}),
    PolicyCase("chunkkv", "chunkkv", {"window_size": 4, "chunk_size": 5}),
    PolicyCase(
        "snapkv-avgpool", "snapkv", {"window_size": 4, "kernel_size": 5, "pooling": "avgpool"}
    ),
    PolicyCase(
        "pyramidkv", "pyramidkv", {"window_size": 4, "kernel_size": 3, "beta": 20.0}, "pyramid"
    ),
    PolicyCase(
        "adakv-snapkv",
        "adakv",
        {"scorer": "snapkv", "scorer_params": {"window_size": 4, "kernel_size": 3}},
        "layer_total",
    ),
    PolicyCase("adakv-knorm", "adakv", {"scorer": "knorm"}, "layer_total"),
    PolicyCase("adakv-h2o", "adakv", {"scorer": "h2o"}, "layer_total"),
    PolicyCase("knorm", "knorm"),
    PolicyCase(
        "fastgen",
        "fastgen",
        {"recovery_threshold": 0.9, "local_ratio": 0.3, "frequency_ratio": 0.3},
        "cap",
    ),
    PolicyCase(
        "duoattention-calibrated", "duoattention", {"sink_size": 2, "recent_size": 4}, "pattern"
    ),
    PolicyCase(
        "duoattention-pattern",
        "duoattention",
        {"sink_size": 2, "recent_size": 4, "threshold": 0.5},
        "pattern",
        shape_params=_duo_pattern,
    ),
    PolicyCase("kvzip", "kvzip", {"n_sink": 2, "window": 4, "max_queries": 16}),
    PolicyCase(
        "kvzip-global",
        "kvzip",
        {"n_sink": 2, "window": 4, "max_queries": 16, "allocation": "global"},
    ),
    PolicyCase("expected_attention", "expected_attention", {"n_sink": 2, "n_future_positions": 8}),
    PolicyCase(
        "expected_attention-window",
        "expected_attention",
        {"n_sink": 2, "n_future_positions": 8, "queries": "window"},
    ),
    PolicyCase("self_info", "self_info", {"n_sink": 2, "smooth": 3, "kernel_size": 5}),
    PolicyCase(
        "expected_attention-mean",
        "expected_attention",
        {"n_sink": 0, "use_covariance": False, "use_vnorm": False, "epsilon": 0.1},
    ),
]
"""Every built-in policy at least once; ids are unique."""


def synthetic_inputs(
    layers: int,
    heads: int,
    length: int,
    head_dim: int,
    *,
    window: int = 4,
    group: int = 2,
    seed: int = 0,
    padded: bool = False,
) -> CompactionInputs:
    """Random but real inputs: keys, values and scores from random queries.

    Args:
        layers, heads, length, head_dim: Shape ``(L, H, T, D)``.
        window: Window queries ``W`` (clipped to T).
        group: Query heads per KV head (GQA).
        seed: Seed of everything random.
        padded: Decode-style candidates (see the module docstring).
    """
    generator = torch.Generator().manual_seed(seed)
    w = min(window, length)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    if padded:
        low = max(1, length // 2)
        counts = torch.randint(low, length + 1, (heads,), generator=generator)
        counts[0] = length  # one head without padding
        valid = torch.arange(length).unsqueeze(0) < counts.unsqueeze(1)
        positions = torch.zeros(heads, length, dtype=torch.int64)
        for h in range(heads):
            n = int(counts[h])
            chosen = torch.randperm(2 * length, generator=generator)[:n]
            positions[h, :n] = torch.sort(chosen).values
    observations = []
    for _ in range(layers):
        keys = randn(heads, length, head_dim) * 1.5
        values = randn(heads, length, head_dim)
        queries = randn(heads * group, length, head_dim) * 1.5
        if not padded:
            mass, attention = window_scores(
                queries[None, :, length - w :], keys[None], return_attention=True
            )
            assert attention is not None
            cumulative = cumulative_scores(queries[None], keys[None])[0]
            context = context_scores(queries[None], keys[None], torch.arange(length))[0]
            observations.append(
                LayerObservation(
                    keys,
                    values,
                    mass[0],
                    attention[0],
                    cumulative,
                    context_scores=context,
                    window_queries=queries[:, length - w :],
                )
            )
            continue
        # decode: the window queries follow every cached token; padding is invisible
        logits = (
            torch.einsum(
                "hgwd,htd->hgwt", queries.view(heads, group, length, head_dim)[:, :, :w], keys
            )
            / head_dim**0.5
        )
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        attention = torch.softmax(logits, dim=-1).mean(dim=1)  # (H, W, T)
        cumulative = attention.sum(dim=1) + torch.rand(heads, length, generator=generator)
        # bait the padding: the most attractive values every policy could read
        attention = attention.masked_fill(~valid[:, None, :], 1.0)
        cumulative = cumulative.masked_fill(~valid, 1e3)
        keys = keys.masked_fill(~valid[..., None], 0.0)
        observations.append(
            LayerObservation(
                keys,
                values,
                attention.sum(dim=1),
                attention,
                cumulative,
                context_scores=attention.amax(dim=1),
                window_queries=queries[:, :w],
            )
        )
    special = torch.zeros(length, dtype=torch.bool)
    special[0] = True
    punctuation = torch.rand(length, generator=generator) < 0.15
    return CompactionInputs(
        num_candidates=length,
        num_kv_heads=heads,
        layers=observations,
        positions=positions if padded else None,
        valid=valid if padded else None,
        special_mask=special,
        punctuation_mask=punctuation & ~special,
        query_positions=torch.arange(2 * length, 2 * length + w)
        if padded
        else torch.arange(length - w, length),
        rope=Rope.from_theta(10_000.0, head_dim - head_dim % 2) if head_dim >= 2 else None,
    )


def expected_tokens(budget: Budget | float | int, length: int) -> int:
    """Tokens per head that a fixed budget resolves to on ``length`` candidates."""
    return Budget.parse(budget).resolve(length)
