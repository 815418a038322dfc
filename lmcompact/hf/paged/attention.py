"""Attention over a block table: torch paths for CPU (and any device).

Two paths, same result up to float rounding:

* :func:`shared_block_attention` (one query per row, the decode step): the
  rows' blocks are deduplicated, so a prompt block shared by every beam is
  read once for all of them. Runs of consecutive block ids are read as views
  of the storage (no copy); the few scattered blocks are gathered::

      union of the rows' blocks   [0 1 2 3 ... 63 | 70 75 81 88]
      key axis                    [ view of run   | gathered   ]
      logits (Hkv, B*G, L)  = Q @ K_union^T           one matmul per part
      row b picks its own slots from the key axis, masks, softmaxes, and
      scatters its probabilities back:  out = P (Hkv, B*G, L) @ V_union

  int8 storage is dequantized on the fly: the key scale multiplies the
  logits, the value scale the probabilities.
* :func:`gathered_attention` (any number of queries): each row's slots are
  gathered and SDPA runs with the kept/hole/causal mask of
  :meth:`BlockTable.visible`. It serves prefill chunks on a non-empty cache
  and is the reference the first path is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmcompact.hf.paged.storage import KVRun, KVStorage
from lmcompact.hf.paged.table import BlockTable

MIN_RUN_BLOCKS = 2
"""Runs of at least this many consecutive blocks are read as views."""


def _union_parts(storage: KVStorage, union: torch.Tensor) -> tuple[list[KVRun], torch.Tensor]:
    """Split sorted unique block ids into view runs and one gathered rest.

    Returns the parts (in key-axis order) and ``(U,)`` the position of each
    union block on the key axis, in blocks.
    """
    ids = union.tolist()
    runs: list[tuple[int, int]] = []
    loose: list[int] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            if i - start >= MIN_RUN_BLOCKS:
                runs.append((start, i))
            else:
                loose.extend(range(start, i))
            start = i
    parts: list[KVRun] = []
    position = torch.empty(len(ids), dtype=torch.int64)
    cursor = 0
    for lo, hi in runs:
        parts.append(storage.block_run(ids[lo], ids[hi - 1] + 1))
        position[lo:hi] = torch.arange(cursor, cursor + hi - lo)
        cursor += hi - lo
    if loose:
        loose_t = torch.tensor(loose, dtype=torch.int64)
        parts.append(storage.block_gather(union[loose_t]))
        position[loose_t] = torch.arange(cursor, cursor + len(loose))
    return parts, position


def _as_float(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return part if part.dtype == dtype else part.to(dtype)


def shared_block_attention(
    query: torch.Tensor, storage: KVStorage, table: BlockTable, scale: float
) -> torch.Tensor:
    """Decode attention of one query per row over the rows' (shared) blocks.

    Args:
        query: ``(B, Hq, 1, D)`` post-RoPE queries.
        storage: The pool's K/V.
        table: The layer's block table; its last slot holds the query's own token.
        scale: Softmax scale.

    Returns:
        ``(B, 1, Hq, D)`` attention output in the query's dtype.
    """
    b, hq, s, d = query.shape
    hkv = table.num_kv_heads
    if s != 1 or b != table.batch_size or hq % hkv:
        raise ValueError(
            f"query must be (B={table.batch_size}, Hq (multiple of {hkv}), 1, D); "
            f"got {tuple(query.shape)}"
        )
    group, bs, n = hq // hkv, table.block_size, table.num_slots
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    union, inverse = torch.unique(table.blocks, sorted=True, return_inverse=True)
    parts, position = _union_parts(storage, union)
    # (B, n): where each row's slot sits on the key axis
    key_index = (position[inverse] * bs).unsqueeze(-1) + torch.arange(bs)
    key_index = key_index.reshape(b, -1)[:, :n].to(query.device)

    q = (query.to(work) * scale).view(b, hkv, group, d).transpose(0, 1).reshape(hkv, b * group, d)
    logits_parts = []
    for part in parts:
        part_logits = torch.matmul(q, _as_float(part.keys, work).transpose(1, 2))
        if part.key_scales is not None:
            part_logits = part_logits * part.key_scales.unsqueeze(1)
        logits_parts.append(part_logits)
    logits = torch.cat(logits_parts, dim=-1).view(hkv, b, group, -1)
    total = logits.shape[-1]

    index = key_index.view(1, b, 1, n).expand(hkv, b, group, n)
    row_logits = torch.gather(logits, 3, index)
    if table.compacted:  # else the one query of a row sees all of its n slots
        visible = table.visible(1)[:, :, 0].to(query.device)  # (B, Hkv, n)
        row_logits = row_logits.masked_fill(~visible.transpose(0, 1).unsqueeze(2), float("-inf"))
    probs = torch.softmax(row_logits, dim=-1)
    spread = torch.zeros(hkv, b, group, total, dtype=work, device=query.device)
    spread.scatter_(3, index, probs)
    spread = spread.view(hkv, b * group, total)

    out = torch.zeros(hkv, b * group, d, dtype=work, device=query.device)
    offset = 0
    for part in parts:
        length = part.keys.shape[1]
        weights = spread[:, :, offset : offset + length]
        if part.value_scales is not None:
            weights = weights * part.value_scales.unsqueeze(1)
        out += torch.matmul(weights, _as_float(part.values, work))
        offset += length
    out = out.view(hkv, b, group, d).transpose(0, 1).reshape(b, 1, hq, d)
    return out.to(query.dtype)


def gathered_attention(
    query: torch.Tensor, storage: KVStorage, table: BlockTable, scale: float
) -> torch.Tensor:
    """Attention of the last ``S`` slots' queries of every row (reference path).

    Args:
        query: ``(B, Hq, S, D)``; query ``i`` of a row sits at slot
            ``num_slots - S + i``.
        storage, table, scale: As in :func:`shared_block_attention`.

    Returns:
        ``(B, S, Hq, D)`` in the query's dtype.
    """
    b, hq, s, _ = query.shape
    hkv = table.num_kv_heads
    group = hq // hkv
    slots = torch.arange(table.num_slots)
    visible = table.visible(s).to(query.device)  # (B, Hkv, S, n)
    outs = []
    for row in range(b):
        blocks, offsets = table.addresses(row, slots)
        k, v = storage.read_slots(blocks, offsets)  # (Hkv, n, D)
        k = k.to(query.dtype).repeat_interleave(group, dim=0).unsqueeze(0)
        v = v.to(query.dtype).repeat_interleave(group, dim=0).unsqueeze(0)
        mask = visible[row].repeat_interleave(group, dim=0).unsqueeze(0)
        outs.append(
            F.scaled_dot_product_attention(query[row : row + 1], k, v, attn_mask=mask, scale=scale)
        )
    return torch.cat(outs, dim=0).transpose(1, 2).contiguous()
