"""One model layer of a :class:`~lmcompact.hf.paged.cache.PagedCache`.

``update()`` is the only write path: it appends the new tokens' K/V to the
layer's block table (copy-on-write of a shared partial block, new blocks from
the pool) and returns the new keys *tagged* with the layer (see
:mod:`lmcompact.hf.attention`). The ``"lmcompact"`` attention function then
calls :meth:`PagedLayer.attend`, which reads the pool through the table::

    update(k, v)  ->  table.append / storage.write  ->  (tagged k, v)
    attend(q)     ->  prefill of an empty layer: causal SDPA on k, v as given
                      decode (1 query/row):  shared_block_attention (CPU) or
                                             the Triton paged kernel (CUDA)
                      other:                 gathered_attention

A decode step that the cache prepared for all layers at once
(:mod:`lmcompact.hf.paged.step`) does no host work here: the token is written
at the addresses in the step's device buffers and the CUDA kernel reads the
tables and lengths from them (float or int8 K/V), so the layer's work can be
captured in a CUDA graph.

A prefill whose rows are bitwise identical (``generate`` repeats the prompt
once per beam) is stored once and its blocks are shared by every row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from lmcompact.hf.attention import causal_sdpa, tag
from lmcompact.hf.paged.attention import gathered_attention, shared_block_attention
from lmcompact.hf.paged.blocks import BlockPool
from lmcompact.hf.paged.step import DecodeState
from lmcompact.hf.paged.storage import KVStorage, StorageSpec
from lmcompact.hf.paged.table import BlockTable, allocate_cleared
from lmcompact.layout.paged import PagedLengths

logger = logging.getLogger(__name__)


@dataclass
class SharedPool:
    """What every layer of one cache shares: the block pool and its storage.

    The storage is created on the first write, when dtype and device are known.
    """

    pool: BlockPool
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    storage: KVStorage | None = None
    prefill_observer: Any = field(default=None)
    step: DecodeState | None = None
    _vectors: dict[tuple[str, int, int, torch.device], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False
    )

    def row_vector(self, kind: str, batch: int, value: int, device: torch.device) -> torch.Tensor:
        """A small device tensor made once per decode step and reused by every layer.

        ``kind`` ``"full"``: ``(batch,)`` int64 filled with ``value``; ``"cu"``:
        ``(batch + 1,)`` int32 offsets ``0, value, 2 * value, ...``.
        """
        key = (kind, batch, value, device)
        out = self._vectors.get(key)
        if out is None:
            if len(self._vectors) > 64:  # past steps' lengths: drop them
                self._vectors.clear()
            if kind == "full":
                out = torch.full((batch,), value, dtype=torch.int64, device=device)
            else:
                out = torch.arange(0, (batch + 1) * value, value, dtype=torch.int32, device=device)
            self._vectors[key] = out
        return out

    def storage_for(self, like: torch.Tensor) -> KVStorage:
        if self.storage is None:
            spec = StorageSpec(
                num_blocks=self.pool.num_blocks,
                block_size=self.block_size,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=like.dtype,
                kv_dtype=self.kv_dtype,
            )
            self.storage = KVStorage(spec, like.device)
        return self.storage


class PagedLayer(CacheLayerMixin):
    """Block table, slot ranges and logical length of one layer.

    Attributes:
        table: The layer's :class:`BlockTable`, None before the first write.
        seen: Tokens this layer has seen (the next token's position).
        kept_positions: ``(B, Hkv, tail_start)`` original positions of the
            compacted slots (valid below ``table.kept``), None if never compacted.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, shared: SharedPool, layer_idx: int) -> None:
        super().__init__()
        self.shared = shared
        self.layer_idx = layer_idx
        self.table: BlockTable | None = None
        self.seen = 0
        self.kept_positions: torch.Tensor | None = None
        self._fresh_prefill = False
        self._awaiting_attend = False
        self.step_ready = False
        self._step_attend = False

    # ------------------------------------------------------------ transformers
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.shared.storage_for(key_states)
        self.table = BlockTable.empty(
            key_states.shape[0], self.shared.num_kv_heads, self.shared.block_size
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``(B, Hkv, S, D)`` new keys/values; return the keys tagged for attention."""
        if self._awaiting_attend:
            raise RuntimeError(
                f"layer {self.layer_idx}: the last update was never attended; a PagedCache "
                "needs the model's attention set to 'lmcompact' "
                "(lmcompact.hf.attention.enable_lmcompact_attention(model))"
            )
        if self.step_ready:
            return self._write_step(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        table, storage = self._state()
        b, h, s, _ = key_states.shape
        if b != table.batch_size or h != table.num_kv_heads:
            raise ValueError(
                f"layer {self.layer_idx}: got K/V for {b} rows x {h} kv heads, the cache holds "
                f"{table.batch_size} rows x {table.num_kv_heads} kv heads"
            )
        if table.num_slots == 0 and b > 1 and _rows_identical(key_states, value_states):
            self._write_shared_prefill(key_states, value_states)
        elif s == 1 and table.num_slots:
            self._write_decode(key_states, value_states)
        else:
            slots = table.append(s, self.shared.pool, storage)
            blocks, offsets = (
                table.blocks.gather(1, slots // table.block_size),
                slots % table.block_size,
            )
            flat = key_states.transpose(0, 1).reshape(h, b * s, -1)
            flat_v = value_states.transpose(0, 1).reshape(h, b * s, -1)
            storage.write(blocks.reshape(-1), offsets.reshape(-1), flat, flat_v)
        self._fresh_prefill = self.seen == 0
        self.seen += s
        self._awaiting_attend = True
        return tag(key_states, self), value_states

    def _write_step(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prepared decode step (table and ``seen`` already moved): write at the step's slot."""
        step, storage = self.shared.step, self.shared.storage
        assert step is not None and storage is not None
        if key_states.shape[0] != step.batch or key_states.shape[2] != 1:
            raise ValueError(
                f"layer {self.layer_idx}: the prepared step is for {step.batch} rows x 1 token, "
                f"got K/V {tuple(key_states.shape)}"
            )
        self.step_ready = False
        storage.write(
            step.write_block[self.layer_idx],
            step.write_offset[self.layer_idx],
            key_states[:, :, 0].transpose(0, 1),
            value_states[:, :, 0].transpose(0, 1),
        )
        self._step_attend = self._awaiting_attend = True
        return tag(key_states, self), value_states

    def _write_decode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """One new token per row: every row writes the same slot of its last block."""
        table, storage = self._state()
        table.append(1, self.shared.pool, storage)
        slot = table.num_slots - 1
        column = slot // table.block_size
        if storage.device.type == "cpu":
            blocks = table.blocks[:, column]
        else:  # the table's device copy is needed by attention anyway: no extra upload
            blocks = table.device_blocks(storage.device)[:, column]
        storage.write(
            blocks,
            slot % table.block_size,
            key_states[:, :, 0].transpose(0, 1),
            value_states[:, :, 0].transpose(0, 1),
        )

    def _write_shared_prefill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        table, storage = self._state()
        b, s = key_states.shape[0], key_states.shape[2]
        bs = table.block_size
        ids = allocate_cleared(self.shared.pool, storage, -(-s // bs))
        self.shared.pool.incref(ids.repeat(b - 1))
        table.blocks = ids.expand(b, -1).clone()
        table.num_slots = s
        slots = torch.arange(s)
        storage.write(ids[slots // bs], slots % bs, key_states[0], value_states[0])
        logger.debug(
            "layer %d: prefill of %d rows stored once (%d blocks)", self.layer_idx, b, len(ids)
        )

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention output ``(B, S, Hq, D)`` for ``(B, Hq, S, D)`` queries of the last update."""
        self._awaiting_attend = False
        table, storage = self._state()
        if self._step_attend:
            self._step_attend = False
            if _use_kernel(query, storage):
                return _step_kernel_attention(query, self.shared, self.layer_idx, scaling)
            return shared_block_attention(query, storage, table, scaling)
        if self._fresh_prefill:
            self._fresh_prefill = False
            observer = self.shared.prefill_observer
            if observer is not None:
                observer.observe_prefill(self, query, key, scaling)
            return causal_sdpa(module, query, key, value, scaling, **kwargs)
        if query.shape[2] == 1:
            if _use_kernel(query, storage) and not storage.spec.quantized:
                return _kernel_attention(query, self.shared, table, scaling)
            return shared_block_attention(query, storage, table, scaling)
        return gathered_attention(query, storage, table, scaling)

    def clear_attend_flags(self) -> None:
        """Forget an update whose attention never ran (a failed graph capture)."""
        self._awaiting_attend = self._step_attend = False

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Permute rows by ``beam_idx``: block ids and counts move, K/V stay where they are."""
        if self.table is None:
            return
        self.table.reorder(beam_idx, self.shared.pool)
        if self.kept_positions is not None:
            self.kept_positions = self.kept_positions[beam_idx.cpu()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.table is not None:
            self._select(torch.arange(self.table.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.table is not None:
            self._select(torch.as_tensor(indices).cpu())

    def _select(self, rows: torch.Tensor) -> None:
        assert self.table is not None
        self.table.select(rows, self.shared.pool)
        if self.kept_positions is not None:
            self.kept_positions = self.kept_positions[rows]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (or keep ``tokens_to_remove``, legacy)."""
        if self.table is None or tokens_to_remove == 0:
            return
        remove = -tokens_to_remove if tokens_to_remove < 0 else self.seen - tokens_to_remove
        if remove <= 0:
            return
        self.table.truncate(self.table.num_slots - remove, self.shared.pool)
        self.seen -= remove

    def reset(self) -> None:
        """Give every block back to the pool; the layer is empty afterwards."""
        if self.table is not None:
            self.table.release(self.shared.pool)
        self.table = None
        self.seen = 0
        self.kept_positions = None
        self._fresh_prefill = self._awaiting_attend = False
        self.step_ready = self._step_attend = False
        self.is_initialized = False

    # ----------------------------------------------------------------- helpers
    def _state(self) -> tuple[BlockTable, KVStorage]:
        if self.table is None or self.shared.storage is None:
            raise RuntimeError(f"layer {self.layer_idx} has no data yet")
        return self.table, self.shared.storage


def _rows_identical(keys: torch.Tensor, values: torch.Tensor) -> bool:
    return all(
        torch.equal(keys[0], keys[row]) and torch.equal(values[0], values[row])
        for row in range(1, keys.shape[0])
    )


def _use_kernel(query: torch.Tensor, storage: KVStorage) -> bool:
    """Whether decode goes to the Triton kernel (CUDA, kernels not forced off)."""
    if query.device.type != "cuda":
        return False
    from lmcompact.kernels.dispatch import use_kernels

    return use_kernels(query.device)


def _step_kernel_attention(
    query: torch.Tensor, shared: SharedPool, layer_idx: int, scaling: float
) -> torch.Tensor:
    """Decode of a prepared step, fixed-grid kernel: ``(B, Hq, 1, D)`` -> ``(B, 1, Hq, D)``.

    Every input is a device buffer of the step (or the pool): no host value
    that changes between steps reaches the launch.
    """
    from lmcompact.kernels.paged_attention import paged_decode_attention

    step, storage = shared.step, shared.storage
    assert step is not None and storage is not None
    b, hq, _, d = query.shape
    key_pool, value_pool = storage.paged_views()
    scales = storage.paged_scale_views()
    out = paged_decode_attention(
        query[:, :, 0],
        key_pool,
        value_pool,
        step.tables[layer_idx],
        step.cu_seqlens_q,
        step.lengths(layer_idx),
        scale=scaling,
        num_splits=step.num_splits,
        key_scales=scales[0] if scales is not None else None,
        value_scales=scales[1] if scales is not None else None,
    )
    return out.view(b, 1, hq, d)


def _kernel_attention(
    query: torch.Tensor, shared: SharedPool, table: BlockTable, scaling: float
) -> torch.Tensor:
    """Decode through the Triton paged kernel (:mod:`lmcompact.kernels.dispatch`), no host sync.

    The table's lengths are exact by construction, so validation is off, and
    the kernel gets the longest query run and visible length as host ints
    (it would read them back from the device otherwise). The block table and
    ``kept`` are uploaded once per change; the per-step vectors are shared by
    all layers.
    """
    from lmcompact.kernels.dispatch import paged_attention

    assert shared.storage is not None
    b, hq, s, d = query.shape
    device = query.device
    key_pool, value_pool = shared.storage.paged_views()
    kept, kept_max = table.device_kept(device)
    lengths = PagedLengths(
        kept=kept,
        tail_start=shared.row_vector("full", b, table.tail_start, device),
        seq_len=shared.row_vector("full", b, table.num_slots, device),
    )
    out, _ = paged_attention(
        query.transpose(1, 2).reshape(b * s, hq, d),
        key_pool,
        value_pool,
        table.device_blocks(device),
        shared.row_vector("cu", b, s, device),
        lengths,
        scale=scaling,
        validate=False,
        max_q_len=s,
        max_visible=kept_max + table.num_slots - table.tail_start,
    )
    return out.view(b, s, hq, d)
