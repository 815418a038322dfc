"""Attention scores from an observation window, in O(W x T) memory.

The last ``W`` queries of a prompt are scored against all ``T`` keys; the
softmax-normalized attention mass each key receives is what SnapKV, PyramidKV,
Ada-KV and H2O rank tokens by. Keys are visited in chunks twice (first the
row-wise log-sum-exp, then the normalized mass), so no ``T x T`` (or even
``W x T``) score matrix is materialized::

    queries (B, Hq, W, D) ──┐ pass 1: lse[w] = logsumexp_j s[w, j]   (chunk by chunk)
    keys    (B, Hkv, T, D) ─┴ pass 2: mass[j] += exp(s[w, j] - lse[w]) (chunk by chunk)

Query heads of a GQA group are averaged, window queries summed.
"""

from __future__ import annotations

import math

import torch

from lmcompact.attention.rope import Rope


def _check_shapes(queries: torch.Tensor, keys: torch.Tensor) -> tuple[int, int]:
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(
            f"queries must be (batch, q_heads, W, head_dim) and keys (batch, kv_heads, T, "
            f"head_dim); got {tuple(queries.shape)} and {tuple(keys.shape)}"
        )
    b, hq, _, d = queries.shape
    bk, hkv, _, dk = keys.shape
    if b != bk or d != dk:
        raise ValueError(
            f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} differ in batch or "
            "head_dim"
        )
    if hq % hkv:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hkv}) for GQA")
    return hkv, hq // hkv


def _default_positions(w: int, t: int, device: torch.device) -> torch.Tensor:
    return torch.arange(t - w, t, device=device)


def window_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 4096,
    return_attention: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention mass per key from the window queries, GQA-aware, chunked over keys.

    Args:
        queries: ``(B, Hq, W, D)`` post-RoPE window queries.
        keys: ``(B, Hkv, T, D)`` post-RoPE keys.
        query_positions: ``(W,)`` positions of the queries (default: the last W);
            key ``j`` is visible to query ``w`` when ``j <= query_positions[w]``.
        scale: Softmax scale (default ``1 / sqrt(D)``).
        chunk_size: Keys per chunk; peak extra memory is ``B * Hq * W * chunk_size``.
        return_attention: Also return the per-query rows ``(B, Hkv, W, T)``
            (GQA-averaged; this output is itself O(W x T)).

    Returns:
        ``(B, Hkv, T)`` float32 mass summed over window queries and averaged over
        the query heads of each KV group, and the optional per-query rows.
    """
    hkv, group = _check_shapes(queries, keys)
    b, _hq, w, d = queries.shape
    t = keys.shape[2]
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if query_positions is None:
        query_positions = _default_positions(w, t, queries.device)
    if t <= chunk_size:
        return _window_scores_one_pass(queries, keys, query_positions, scale, return_attention)
    q = queries.float().reshape(b, hkv, group, w, d) * scale
    q_pos = query_positions.to(queries.device).view(1, 1, 1, w, 1)

    def chunk_logits(start: int) -> torch.Tensor:
        k = keys[:, :, start : start + chunk_size].float()
        logits = torch.einsum("bhgwd,bhtd->bhgwt", q, k)
        k_pos = torch.arange(start, start + k.shape[2], device=queries.device)
        return logits.masked_fill(k_pos.view(1, 1, 1, 1, -1) > q_pos, float("-inf"))

    lse = torch.full((b, hkv, group, w, 1), float("-inf"), device=queries.device)
    for start in range(0, t, chunk_size):
        lse = torch.logaddexp(lse, torch.logsumexp(chunk_logits(start), dim=-1, keepdim=True))
    lse = lse.masked_fill(torch.isinf(lse), 0.0)  # queries that see nothing contribute 0

    mass = torch.empty(b, hkv, t, device=queries.device)
    attention = torch.empty(b, hkv, w, t, device=queries.device) if return_attention else None
    for start in range(0, t, chunk_size):
        probs = torch.exp(chunk_logits(start) - lse)
        end = start + probs.shape[-1]
        mass[:, :, start:end] = probs.sum(dim=3).mean(dim=2)
        if attention is not None:
            attention[:, :, :, start:end] = probs.mean(dim=2)
    return mass, attention


def _window_scores_one_pass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    return_attention: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`window_scores` when every key fits in one chunk: one ``(W x T)`` product,
    in-place softmax, the causal mask written only where a key can follow a query."""
    hkv, group = _check_shapes(queries, keys)
    b, _hq, w, d = queries.shape
    t = keys.shape[2]
    q = queries.float().reshape(b, hkv, group * w, d) * scale
    logits = torch.matmul(q, keys.float().transpose(-1, -2)).view(b, hkv, group, w, t)
    q_pos = query_positions.to(queries.device)
    first = max(0, int(q_pos.min()) + 1)  # keys before this are visible to every query
    if first < t:
        k_pos = torch.arange(first, t, device=queries.device)
        logits[..., first:].masked_fill_(k_pos.view(1, -1) > q_pos.view(-1, 1), float("-inf"))
    top = logits.amax(dim=-1, keepdim=True)
    top.masked_fill_(torch.isinf(top), 0.0)  # queries that see nothing contribute 0
    logits.sub_(top).exp_()
    total = logits.sum(dim=-1, keepdim=True)
    logits.mul_(torch.where(total > 0, total.reciprocal(), torch.zeros_like(total)))
    rows = logits.mean(dim=2)  # (B, Hkv, W, T): GQA-averaged per-query rows
    return rows.sum(dim=2), rows if return_attention else None


def window_scores_naive(
    queries: torch.Tensor, keys: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """The eager way: full ``(T x T)`` causal attention for all queries, last W rows kept.

    This is what ``output_attentions=True`` with eager attention costs; it
    exists as the baseline of ``lmcompact bench scores`` and as a test oracle.

    Args:
        queries: ``(B, Hq, T, D)`` all queries of the prompt.
        keys: ``(B, Hkv, T, D)``.

    Returns:
        ``(B, Hkv, T)`` mass of the last ``W = T`` rows summed (callers slice
        queries first when they want a shorter window).
    """
    hkv, group = _check_shapes(queries, keys)
    b, _hq, tq, d = queries.shape
    t = keys.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = keys.float().repeat_interleave(group, dim=1)
    logits = torch.matmul(queries.float(), k.transpose(-1, -2)) * scale
    q_pos = torch.arange(t - tq, t, device=queries.device).view(-1, 1)
    logits = logits.masked_fill(torch.arange(t, device=queries.device) > q_pos, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs.sum(dim=2).view(b, hkv, group, t).mean(dim=2)


def cumulative_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    scale: float | None = None,
    query_chunk: int = 256,
    key_chunk: int = 4096,
) -> torch.Tensor:
    """H2O's accumulated attention: mass per key summed over *every* prompt query.

    Queries go in blocks of ``query_chunk``; a block is scored only against the
    keys it can see (causal), which halves the work of a prefill. A block whose
    visible keys fit in ``key_chunk`` takes one pass (``exp(s - max)``, then the
    row normalizers folded into a matrix product); longer ones go through
    :func:`window_scores`, so memory stays ``O(query_chunk x key_chunk)``.

    Args:
        queries: ``(B, Hq, T, D)``; keys: ``(B, Hkv, T, D)``.

    Returns:
        ``(B, Hkv, T)`` float32.
    """
    hkv, group = _check_shapes(queries, keys)
    b, _hq, tq, d = queries.shape
    t = keys.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    total = torch.zeros(b, hkv, t, device=queries.device)
    for start in range(0, tq, query_chunk):
        block = queries[:, :, start : start + query_chunk]
        n = block.shape[2]
        first = t - tq + start  # position of the block's first query
        visible = first + n
        if visible > key_chunk:
            positions = torch.arange(first, visible, device=queries.device)
            mass, _ = window_scores(
                block,
                keys[:, :, :visible],
                query_positions=positions,
                scale=scale,
                chunk_size=key_chunk,
            )
            total[:, :, :visible] += mass
            continue
        q = block.float().reshape(b, hkv, group * n, d) * scale
        logits = torch.matmul(q, keys[:, :, :visible].float().transpose(-1, -2))
        # causal: query i of the block (position first + i) sees keys <= first + i
        hidden = torch.ones(n, n, dtype=torch.bool, device=queries.device).triu(diagonal=1)
        tail = logits.view(b, hkv, group, n, visible)[..., first:]
        tail.masked_fill_(hidden, float("-inf"))
        logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        weights = logits.sum(dim=-1).reciprocal_().unsqueeze(-2)  # (B, Hkv, 1, G*n)
        total[:, :, :visible] += torch.matmul(weights, logits).squeeze(-2) / group
    return total


def context_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    *,
    scale: float | None = None,
    query_chunk: int = 128,
    shift: int | None = None,
    rope: Rope | None = None,
) -> torch.Tensor:
    """Per key, the largest softmax attention weight any of the given queries gives it.

    Each query sees the keys at positions ``<= its own`` (causal) and its row is
    normalized over exactly those keys, as in the model's own attention. With ``shift``
    the queries are first moved ``shift`` positions later with ``rope`` (post-RoPE
    vectors: ``R(p + shift) = R(shift) R(p)``) and see every key, as the same tokens
    would if they were repeated after the context (KVzip's reconstruction pass). The score
    of key ``j`` is the maximum of its weight over the queries and over the query
    heads of its KV group (KVzip's aggregation). Queries go in blocks of
    ``query_chunk`` against the keys the block can see, so the extra memory is
    ``Hq x query_chunk x T`` floats, never ``S x T`` or ``T x T``::

        queries (B, Hq, S, D), positions (S,)   block of n queries at positions p
        keys    (B, Hkv, T, D)                  w = softmax(q k^T * scale) over keys <= p
                                                score[j] = max(score[j], max_{g, q} w[g, q, j])

    Args:
        queries: ``(B, Hq, S, D)`` post-RoPE queries (any subset of the prompt's).
        keys: ``(B, Hkv, T, D)`` post-RoPE keys; key ``j`` sits at position ``j``.
        query_positions: ``(S,)`` positions of the queries in ``[0, T)``.
        scale: Softmax scale (default ``1 / sqrt(D)``).
        query_chunk: Queries per block.
        shift: Move the queries this many positions later and drop the causal mask.
        rope: The model's RoPE (needed with ``shift``).

    Returns:
        ``(B, Hkv, T)`` float32 scores in ``[0, 1]``; keys no query sees score 0.
    """
    hkv, group = _check_shapes(queries, keys)
    b, _hq, s, d = queries.shape
    t = keys.shape[2]
    if query_positions.shape != (s,):
        raise ValueError(
            f"query_positions must have shape ({s},) to match the queries, got "
            f"{tuple(query_positions.shape)}"
        )
    if query_chunk <= 0:
        raise ValueError(f"query_chunk must be > 0, got {query_chunk}")
    positions = query_positions.to(queries.device, torch.int64)
    if s and (int(positions.min()) < 0 or int(positions.max()) >= t):
        raise ValueError(f"query positions must lie in [0, {t}) (the keys), got out-of-range ones")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    causal = shift is None
    if shift is not None:
        if rope is None:
            raise ValueError("context_scores with shift= needs rope= to move the queries")
        queries = rope.rotate(queries.float(), torch.full((s,), float(shift)))
    order = torch.argsort(positions)
    positions = positions[order]
    q_all = queries.float()[:, :, order].reshape(b, hkv, group, s, d) * scale
    best = torch.zeros(b, hkv, t, device=queries.device)
    for start in range(0, s, query_chunk):
        pos = positions[start : start + query_chunk]
        visible = int(pos.max()) + 1 if causal else t
        q = q_all[:, :, :, start : start + query_chunk]
        k = keys[:, :, :visible].float()
        logits = torch.einsum("bhgnd,bhtd->bhgnt", q, k)
        if causal:
            hidden = torch.arange(visible, device=queries.device).view(1, -1) > pos.view(-1, 1)
            logits.masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        top = weights.amax(dim=(2, 3))  # (B, Hkv, visible)
        torch.maximum(best[:, :, :visible], top, out=best[:, :, :visible])
    return best


def reconstruction_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    context_len: int,
    *,
    scale: float | None = None,
    query_chunk: int = 128,
) -> torch.Tensor:
    """KVzip's scores of a context's keys from the queries of its reconstruction.

    The sequence is ``context (T) + repeat prompt + context again``; the queries are
    (some of) the second copy's, each at its own position. Every query attends causally
    to all keys up to its position, normalized over exactly those keys (the model's own
    attention row); a context key's score is the largest weight any query and any query
    head of its GQA group gives it (:func:`context_scores` restricted to the first
    ``context_len`` keys). Calls on disjoint query sets combine with ``torch.maximum``,
    so a chunked prefill can score each step's queries as they come::

        keys       [ context 0..T-1 | repeat prompt | copy ..... ]
        queries                                     [ q at p ... ]  sees keys <= p
        score[j] = max_{q, g} softmax_j(q k_j^T * scale)[j],  j < T

    Args:
        queries: ``(B, Hq, S, D)`` post-RoPE queries of the repeated copy.
        keys: ``(B, Hkv, N, D)`` post-RoPE keys of the sequence from position 0, with
            ``N > max(query_positions)`` (keys past a query are masked).
        query_positions: ``(S,)`` positions of the queries, each ``>= context_len``.
        context_len: ``T``, the keys that get scores.
        scale: Softmax scale (default ``1 / sqrt(D)``).
        query_chunk: Queries per block (memory ``Hq x query_chunk x N`` floats).

    Returns:
        ``(B, Hkv, T)`` float32 scores in ``[0, 1]``.
    """
    if context_len <= 0 or context_len > keys.shape[2]:
        raise ValueError(
            f"context_len must be in [1, {keys.shape[2]}] (the keys), got {context_len}"
        )
    if query_positions.numel() and int(query_positions.min()) < context_len:
        raise ValueError(
            f"reconstruction queries must sit after the context (positions >= {context_len}), "
            f"got {int(query_positions.min())}"
        )
    scores = context_scores(queries, keys, query_positions, scale=scale, query_chunk=query_chunk)
    return scores[:, :, :context_len]
