"""KeepPlans of :class:`~lmcompact.hf.cache.CompactingCache`: what its policy is given.

:func:`plan_prefill` builds the :class:`CompactionInputs` of one sequence at the end of
the prefill (per-layer K/V and observations, token classes, RoPE); :func:`replan_layer`
re-plans one layer during decode from the ragged K/V and the key mass of the last step;
:func:`tail_window` cuts a recorded observation window to a shorter one (a fork).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmcompact.hf.observe import PrefillObservation, pad_flat
from lmcompact.layout.ragged import RaggedLayer
from lmcompact.plan import KeepPlan
from lmcompact.policies.base import CompactionInputs, LayerObservation, Need

if TYPE_CHECKING:
    from lmcompact.hf.cache import CompactingCache


def plan_prefill(cache: CompactingCache, b: int, length: int) -> KeepPlan:
    """Sequence ``b``'s KeepPlan from the recorded prefill (dense K/V ``(B, H, T, D)``
    and each layer's observation), validated for the model's layers and heads."""
    observations = []
    query_positions = None
    for layer in cache._layers():
        assert layer.keys is not None and layer.values is not None
        obs = layer.observation or PrefillObservation()
        observations.append(
            LayerObservation(
                keys=layer.keys[b] if Need.KEYS in cache.needs else None,
                values=layer.values[b] if Need.KEYS in cache.needs else None,
                window_scores=None if obs.window_scores is None else obs.window_scores[b],
                window_attention=(
                    None if obs.window_attention is None else obs.window_attention[b]
                ),
                cumulative_scores=(
                    None if obs.cumulative_scores is None else obs.cumulative_scores[b]
                ),
                context_scores=None if obs.context_scores is None else obs.context_scores[b],
                window_queries=None if obs.window_queries is None else obs.window_queries[b],
            )
        )
        if obs.window_queries is not None:
            query_positions = obs.query_positions
            if query_positions is None:
                query_positions = torch.arange(length - obs.window_queries.shape[2], length)
    observations, query_positions = _policy_queries(cache, observations, query_positions, length)
    special = punct = None
    if cache.classifier is not None:
        if cache._prompt_ids is None or cache._prompt_ids.shape[-1] != length:
            raise ValueError("token classes need input_ids (not inputs_embeds) in the prompt")
        special, punct = cache.classifier.masks(cache._prompt_ids[b])
    inputs = CompactionInputs(
        num_candidates=length,
        num_kv_heads=cache.num_kv_heads,
        layers=observations,
        special_mask=special,
        punctuation_mask=punct,
        query_positions=query_positions,
        rope=cache.rope,
        attention_scale=cache.attention_scale,
    )
    plan = cache.policy.plan(inputs)
    plan.validate_for(cache.num_layers, cache.num_kv_heads, length)
    return plan


def _policy_queries(
    cache: CompactingCache,
    observations: list[LayerObservation],
    positions: torch.Tensor | None,
    length: int,
) -> tuple[list[LayerObservation], torch.Tensor | None]:
    """The recorded window queries cut to what this cache's policy reads: the last
    ``window_size`` positions and the policy's ``context_queries`` (a fork's recording
    may hold more)."""
    if positions is None:
        return observations, None
    wanted = positions >= length - cache.window_size
    sampled = cache.policy.context_queries(length)
    if sampled is not None:
        wanted |= torch.isin(positions, sampled)
    if bool(wanted.all()):
        return observations, positions
    for obs in observations:
        if obs.window_queries is not None:
            obs.window_queries = obs.window_queries[:, wanted.to(obs.window_queries.device)]
    return observations, positions[wanted]


def replan_layer(
    cache: CompactingCache, ragged: RaggedLayer, mass: torch.Tensor | None, target: int
) -> RaggedLayer:
    """One layer re-planned during decode: every head of every sequence back to ``target``
    tokens, scored from the last step's key ``mass`` (flat, as the ragged attention gives
    it) and the accumulated scores."""
    keys, values, positions, valid = ragged.padded()
    padded_mass = None if mass is None else pad_flat(ragged, mass)
    padded_scores = None if ragged.scores is None else pad_flat(ragged, ragged.scores)
    keep: list[torch.Tensor] = []
    for b in range(ragged.batch_size):
        window = None if padded_mass is None else padded_mass[b]
        obs = LayerObservation(
            keys=keys[b] if Need.KEYS in cache.needs else None,
            values=values[b] if Need.KEYS in cache.needs else None,
            window_scores=window if Need.WINDOW_SCORES in cache.needs else None,
            window_attention=(
                window[:, None, :]
                if window is not None and Need.WINDOW_ATTENTION in cache.needs
                else None
            ),
            cumulative_scores=padded_scores[b] if padded_scores is not None else None,
        )
        inputs = CompactionInputs(
            num_candidates=keys.shape[2],
            num_kv_heads=cache.num_kv_heads,
            layers=[obs],
            positions=positions[b].clamp(min=0),
            valid=valid[b],
            budget_tokens=target,
        )
        plan = cache.policy.plan(inputs)
        keep.extend(plan.kept[0])
    return ragged.gather(keep)


def tail_window(obs: PrefillObservation, window: int) -> PrefillObservation:
    """The observation of the last ``window`` queries of a recorded longer window (the
    window queries stay whole, with their positions: :func:`plan_prefill` cuts them to
    what the fork's policy reads)."""
    assert obs.window_attention is not None
    rows = obs.window_attention[:, :, -window:]
    return PrefillObservation(
        window_scores=rows.sum(dim=2),
        window_attention=rows,
        cumulative_scores=obs.cumulative_scores,
        context_scores=obs.context_scores,
        window_queries=obs.window_queries,
        query_positions=obs.query_positions,
    )
