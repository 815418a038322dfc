"""KeepPlans of :class:`~lmcompact.hf.cache.CompactingCache`: what its policy is given.

:func:`prefill_plans` plans every sequence at the end of the prefill from its layers'
dense K/V and observations (:func:`lmcompact.compaction.policy_inputs.layer_observation`);
:func:`replan_layer` re-plans one layer during decode from the ragged K/V and the key mass
of the last step; :func:`tail_window` cuts recorded observations to a shorter window (a
fork). The cache calls these with what they need; nothing here knows the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from lmcompact.attention.rope import Rope
from lmcompact.compaction.policy_inputs import compaction_inputs, layer_observation
from lmcompact.hf.compacting_layer import CompactingLayer
from lmcompact.hf.observe import pad_flat
from lmcompact.layout.ragged import RaggedLayer
from lmcompact.plan import KeepPlan
from lmcompact.policies import CompactionPolicy, LayerObservation, Need


def prefill_plans(
    policy: CompactionPolicy,
    needs: Need,
    layers: Sequence[CompactingLayer],
    *,
    window_size: int,
    query_positions: torch.Tensor | None = None,
    token_masks: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    rope: Rope | None = None,
    attention_scale: float | None = None,
) -> list[KeepPlan]:
    """One KeepPlan per sequence from the recorded prefill (dense K/V ``(B, H, T, D)``
    and each layer's observations), validated for the model's layers and heads.

    Args:
        policy: The policy that plans; ``needs`` what it reads (the cache's needs).
        layers: The cache's layers, holding the prefill.
        window_size: The policy's observation window.
        query_positions: ``(W,)`` positions of the recorded window queries.
        token_masks: Per sequence, its special and punctuation masks.
        rope, attention_scale: The model's, as far as known.
    """
    first = layers[0]
    assert first.keys is not None
    batch, heads, length, _ = first.keys.shape
    wanted = None
    if Need.WINDOW_QUERIES in needs:
        wanted = _policy_queries(policy, query_positions, window_size, length)
    plans = []
    for b in range(batch):
        observations = []
        for layer in layers:
            assert layer.keys is not None and layer.values is not None
            recorded = layer.observations[b] if layer.observations else None
            if recorded is not None and wanted is not None and recorded.window_queries is not None:
                recorded = replace(
                    recorded,
                    window_queries=recorded.window_queries[
                        :, wanted.to(recorded.window_queries.device)
                    ],
                )
            observations.append(
                layer_observation(needs, layer.keys[b], layer.values[b], observed=recorded)
            )
        inputs = compaction_inputs(
            needs,
            observations,
            length,
            heads,
            token_masks=None if token_masks is None else token_masks[b],
            query_positions=(
                query_positions
                if wanted is None or query_positions is None
                else query_positions[wanted]
            ),
            rope=rope,
            attention_scale=attention_scale,
        )
        plan = policy.plan(inputs)
        plan.validate_for(len(layers), heads, length)
        plans.append(plan)
    return plans


def _policy_queries(
    policy: CompactionPolicy, positions: torch.Tensor | None, window_size: int, length: int
) -> torch.Tensor | None:
    """Which recorded window queries the policy reads: the last ``window_size`` positions
    and its ``context_queries`` (a fork's recording may hold more); None: all of them."""
    if positions is None:
        return None
    wanted = positions >= length - window_size
    sampled = policy.context_queries(length)
    if sampled is not None:
        wanted |= torch.isin(positions, sampled)
    return None if bool(wanted.all()) else wanted


def replan_layer(
    policy: CompactionPolicy,
    needs: Need,
    ragged: RaggedLayer,
    mass: torch.Tensor | None,
    target: int,
    *,
    recent_queries: torch.Tensor | None = None,
    recent_positions: torch.Tensor | None = None,
    scale: float | None = None,
    protect_before: int | None = None,
    first_visible: int | None = None,
    sliding_window: int | None = None,
) -> RaggedLayer:
    """One layer re-planned during decode: every head of every sequence back to ``target``
    tokens, scored from the accumulated scores and either the last step's key ``mass``
    (flat, as the ragged attention gives it; a window of one query) or, when given, the
    attention of the ``recent_queries`` ``(B, Hq, W, D)`` at ``recent_positions`` ``(W,)``
    over the kept keys (:func:`decode_window_attention`). ``protect_before``: keys at
    earlier positions (the prompt's kept ones) all stay and ``target`` counts the rest.
    A sliding-window layer passes its ``sliding_window`` and ``first_visible`` (the oldest
    position the next query sees): keys before it are dropped, protected or not, and the
    recent queries' rows see only their own windows."""
    keys, values, positions, valid = ragged.padded()
    if first_visible is not None:
        valid = valid & (positions >= first_visible)
    protected = None
    if protect_before is not None:
        protected = valid & (positions < protect_before)
        valid = valid & ~protected
    padded_mass = None if mass is None else pad_flat(ragged, mass)
    padded_scores = None if ragged.scores is None else pad_flat(ragged, ragged.scores)
    rows = None
    if recent_queries is not None and recent_positions is not None:
        rows = decode_window_attention(
            recent_queries, recent_positions, keys, positions, valid, scale, sliding_window
        )
    keep: list[torch.Tensor] = []
    for b in range(ragged.batch_size):
        attention: torch.Tensor | None
        window: torch.Tensor | None
        if rows is not None:
            attention = rows[b]
            window = attention.sum(dim=1)
        else:
            window = None if padded_mass is None else padded_mass[b]
            attention = None if window is None else window[:, None, :]
        observed = LayerObservation(
            window_scores=window,
            window_attention=attention,
            cumulative_scores=None if padded_scores is None else padded_scores[b],
        )
        inputs = compaction_inputs(
            needs,
            [layer_observation(needs, keys[b], values[b], observed=observed)],
            keys.shape[2],
            keys.shape[1],
            positions=positions[b].clamp(min=0),
            valid=valid[b],
            budget_tokens=target,
        )
        plan = policy.plan(inputs)
        if protected is None:
            keep.extend(plan.kept[0])
            continue
        for head, chosen in enumerate(plan.kept[0]):
            fixed = torch.nonzero(protected[b, head]).flatten().to(chosen.device)
            keep.append(torch.sort(torch.cat([fixed, chosen.long()])).values)
    return ragged.gather(keep)


def decode_window_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    valid: torch.Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Softmax attention rows of the last decode queries over a padded ragged cache.

    Args:
        queries: ``(B, Hq, W, D)`` post-RoPE queries.
        query_positions: ``(W,)`` their positions.
        keys: ``(B, H, L, D)`` kept keys, padded.
        key_positions: ``(B, H, L)`` their original positions.
        valid: ``(B, H, L)`` bool, False for padding.
        scale: softmax scale (default ``1 / sqrt(D)``).
        sliding_window: a sliding-window layer's window: a query sees keys less than this
            many positions behind it.

    Returns:
        ``(B, H, W, L)`` float32: each query's row over the keys it sees (kept, at or before
        its position), averaged over the query heads of each kv group; 0 on padding.
    """
    b, hq, w, d = queries.shape
    h = keys.shape[1]
    scale = d**-0.5 if scale is None else scale
    q = queries.float().view(b, h, hq // h, w, d)
    logits = torch.einsum("bhgwd,bhld->bhgwl", q, keys.float()) * scale
    at = query_positions.to(keys.device)[None, None, :, None]
    seen = valid[:, :, None, :] & (key_positions[:, :, None, :] <= at)  # (B, H, W, L)
    if sliding_window is not None:
        seen &= key_positions[:, :, None, :] > at - int(sliding_window)
    logits = logits.masked_fill(~seen[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=2)


def tail_window(observations: list[LayerObservation], window: int) -> list[LayerObservation]:
    """The observations of the last ``window`` queries of a recorded longer window (the
    window queries stay whole: :func:`prefill_plans` cuts them to what the policy reads)."""
    out = []
    for obs in observations:
        assert obs.window_attention is not None
        rows = obs.window_attention[:, -window:]
        out.append(replace(obs, window_scores=rows.sum(dim=1), window_attention=rows))
    return out
