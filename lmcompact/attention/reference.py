"""Reference attention over ragged per-head KV (torch; CPU and GPU).

Every (sequence, kv_head) has its own kept tokens and length. A query at
logical position ``p`` sees the kept keys with position ``<= p`` of its KV head,
so newly appended decode tokens attend exactly to the kept prefix plus the new
tokens before them. The GPU kernels are checked against this function.
"""

from __future__ import annotations

import math

import torch

from lmcompact.layout.ragged import RaggedLayer


def ragged_attention(
    queries: torch.Tensor,
    layer: RaggedLayer,
    query_positions: torch.Tensor,
    *,
    scale: float | None = None,
    return_key_mass: bool = False,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of ``queries`` over the kept tokens of ``layer``.

    Args:
        queries: ``(B, Hq, S, D)``; ``Hq`` a multiple of the layer's kv heads.
        layer: Ragged K/V with ``B * Hkv`` segments.
        query_positions: ``(B, S)`` logical positions of the queries.
        scale: Softmax scale (default ``1 / sqrt(D)``).
        return_key_mass: Also return the attention mass each kept key received.
        window: Sliding-window layers: a query sees only kept keys less than ``window``
            positions behind it (by logical position); None: every earlier key.

    Returns:
        Output ``(B, Hq, S, D)`` in the queries' dtype (zeros for a query that
        sees no key), and, if asked, ``(N,)`` float32 mass per flat key: summed
        over the ``S`` queries, averaged over the query heads of the KV group
        (the same aggregation as :func:`~lmcompact.attention.scores.window_scores`).
    """
    if queries.dim() != 4:
        raise ValueError(f"queries must be (batch, q_heads, S, head_dim), got {queries.shape}")
    b, hq, s, d = queries.shape
    hkv = layer.num_kv_heads
    if b != layer.batch_size or d != layer.head_dim or hq % hkv:
        raise ValueError(
            f"queries {tuple(queries.shape)} do not fit the layer: batch {layer.batch_size}, "
            f"kv heads {hkv} (q_heads must be a multiple), head_dim {layer.head_dim}"
        )
    if query_positions.shape != (b, s):
        raise ValueError(f"query_positions must be ({b}, {s}), got {tuple(query_positions.shape)}")
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    keys, values, positions, mask = layer.padded()  # (B, Hkv, L, D), (B, Hkv, L)
    q = queries.float().view(b, hkv, group, s, d)
    logits = torch.einsum("bhgsd,bhld->bhgsl", q, keys.float()) * scale
    query_at = query_positions.view(b, 1, 1, s, 1).to(positions.device)
    key_at = positions[:, :, None, None, :]
    visible = mask[:, :, None, None, :] & (key_at <= query_at)
    if window is not None:
        visible &= key_at > query_at - window
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    out = torch.einsum("bhgsl,bhld->bhgsd", probs, values.float())
    out = out.reshape(b, hq, s, d).to(queries.dtype)
    if not return_key_mass:
        return out, None
    mass_padded = probs.sum(dim=3).mean(dim=2)  # (B, Hkv, L)
    return out, mass_padded.reshape(b * hkv, -1)[mask.reshape(b * hkv, -1)]


def dense_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain causal GQA attention on dense tensors (test oracle).

    Args:
        queries: ``(B, Hq, S, D)``; keys/values ``(B, Hkv, T, D)``.
        query_positions: ``(B, S)``; key_positions: ``(B, T)``.
    """
    _b, hq, _s, d = queries.shape
    group = hq // keys.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    logits = torch.matmul(queries.float(), k.transpose(-1, -2)) * scale
    visible = key_positions[:, None, None, :] <= query_positions[:, None, :, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v).to(queries.dtype)
