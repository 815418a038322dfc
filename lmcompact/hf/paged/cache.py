"""PagedCache: a transformers ``Cache`` over a preallocated pool of KV blocks.

Use it with ``model.generate`` after switching the model's attention to
``"lmcompact"``::

    from lmcompact.hf.attention import enable_lmcompact_attention
    from lmcompact.hf.paged import PagedCache

    enable_lmcompact_attention(model)
    cache = PagedCache(model.config, num_blocks=4096, block_size=64)
    out = model.generate(ids, num_beams=4, past_key_values=cache)
    cache.reset()                       # every block back to the pool

One :class:`~lmcompact.hf.paged.blocks.BlockPool` serves all layers; each
layer has its own block table (so per-layer compaction frees per-layer
blocks)::

    pool    [ L0 prompt | L1 prompt | ... | L0 beam tails | L1 ... | free ... ]
    layer 0 table  row b -> [ 0  1  2 ... | 961 ]
    layer 1 table  row b -> [ 32 33 34 ...| 962 ]

Beam search calls :meth:`reorder_cache`: rows of every table are permuted and
reference counts move; no K/V is copied, except the partly filled last block
when two beams that share it next write (copy-on-write). ``kv_dtype="int8"``
stores K/V as int8 with per-(head, token) scales; ``policy`` compacts the
prompt at the end of prefill with any lmcompact policy, freeing whole blocks.

Each decode step's host work (slots, copy-on-write, tables and lengths) is
done once for all layers at layer 0 (:meth:`PagedCache.prepare_decode_step`,
:mod:`lmcompact.hf.paged.step`); the layers then only write K/V and attend
from device buffers, which is what lets :mod:`lmcompact.hf.paged.graph`
replay the decode forward as a CUDA graph.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.cache_utils import Cache

from lmcompact.hf.paged.blocks import BlockPool
from lmcompact.hf.paged.compaction import PrefillObserver, compact_layers
from lmcompact.hf.paged.layer import PagedLayer, SharedPool
from lmcompact.hf.paged.step import WIDTH_HEADROOM, DecodeState, append_token
from lmcompact.hf.paged.storage import KV_DTYPES, KVStorage, StorageSpec
from lmcompact.hf.paged.table import BlockTable
from lmcompact.plan import KeepPlan
from lmcompact.policies import CompactionPolicy

logger = logging.getLogger(__name__)


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def blocks_needed(config: Any, rows: int, max_tokens: int, block_size: int = 64) -> int:
    """Blocks for ``rows`` sequences of up to ``max_tokens`` with no sharing at all.

    Includes one spare block per row and layer for copy-on-write. Beam search
    with a shared prompt uses far fewer; this is the safe upper bound.
    """
    per_row = -(-max_tokens // block_size) + 1
    return int(config.num_hidden_layers) * rows * per_row


class PagedCache(Cache):
    """A paged KV cache for Llama-family models in ``generate`` (greedy, sampling, beams).

    Args:
        config: The model config (layers, kv heads, head_dim are read from it).
        num_blocks: Blocks in the pool, shared by all layers (see :func:`blocks_needed`).
        block_size: Token slots per block.
        kv_dtype: ``"auto"`` (the model's dtype) or ``"int8"``.
        policy: Optional compaction policy applied at the end of prefill.
        window_size: Observation window for the policy's attention statistics.
    """

    def __init__(
        self,
        config: Any,
        *,
        num_blocks: int,
        block_size: int = 64,
        kv_dtype: str = "auto",
        policy: CompactionPolicy | None = None,
        window_size: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if "sliding_attention" in (getattr(text_config, "layer_types", None) or ()):
            # its decode kernels attend to every kept key; a sliding layer must not
            raise ValueError(
                "PagedCache does not mask sliding-window layers (this model has some, e.g. "
                "Gemma-3); use CompactingCache or transformers' own caches for it"
            )
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        self.shared = SharedPool(
            pool=BlockPool(num_blocks),
            block_size=block_size,
            num_kv_heads=int(config.num_key_value_heads),
            head_dim=_head_dim(config),
            kv_dtype=kv_dtype,
        )
        self.observer = PrefillObserver(policy, window_size) if policy is not None else None
        self.shared.prefill_observer = self.observer
        self.last_plan: KeepPlan | None = None
        layers = [PagedLayer(self.shared, i) for i in range(int(config.num_hidden_layers))]
        super().__init__(layers=layers)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ writes
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact first if a prefill just ended, then write through the layer.

        At layer 0 of a decode step (one token per row into a cache that holds
        the rows' prompts) the step is prepared for every layer at once
        (:meth:`prepare_decode_step`), unless a caller already did.
        """
        if layer_idx == 0:
            if self.observer is not None and self.observer.pending:
                self.compact_now()
            first = self.paged_layers[0]
            if (
                key_states.shape[2] == 1
                and not first.step_ready
                and self.decoding(key_states.shape[0])
            ):
                self.prepare_decode_step()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def decoding(self, batch: int) -> bool:
        """Whether the next one-token forward of ``batch`` rows is a decode step of this cache.

        True when every layer holds ``batch`` rows of tokens and no compaction waits.
        """
        if self.observer is not None and self.observer.pending:
            return False
        for layer in self.paged_layers:
            table = layer.table
            if table is None or table.num_slots == 0 or table.batch_size != batch:
                return False
        return self.shared.storage is not None

    def prepare_decode_step(self) -> DecodeState:
        """Host work of one decode step for all layers: room for a token, then one upload.

        Every layer's rows get one slot (copy-on-write / new blocks, one pool
        call for all layers, see :func:`~lmcompact.hf.paged.step.append_token`),
        ``seen`` moves on, and the step's device buffers are refreshed. The
        layers' next ``update`` then only writes K/V. Call it before a decode
        forward that runs no Python (a CUDA graph replay); the cache calls it
        itself otherwise.
        """
        layers = self.paged_layers
        tables = [layer.table for layer in layers]
        storage = self.shared.storage
        if storage is None or any(t is None for t in tables):
            raise RuntimeError("prepare_decode_step needs a cache that holds a prefill")
        ready = [t for t in tables if t is not None]
        append_token(ready, self.pool, storage)
        for layer in layers:
            layer.seen += 1
        self.shared.step = state = self._state_for(ready, storage)
        state.fill(ready)
        self.mark_step_prepared()
        return state

    def mark_step_prepared(self) -> None:
        """Let every layer's next ``update`` write into the prepared step (graph capture)."""
        for layer in self.paged_layers:
            layer.step_ready = True

    def clear_step_flags(self) -> None:
        """Forget a prepared step no forward consumed (after a failed graph capture)."""
        for layer in self.paged_layers:
            layer.step_ready = False
            layer.clear_attend_flags()

    def _state_for(self, tables: list[BlockTable], storage: KVStorage) -> DecodeState:
        """The step buffers, rebuilt when the batch or table width outgrows them."""
        columns = max(t.blocks.shape[1] for t in tables)
        batch, heads = tables[0].batch_size, tables[0].num_kv_heads
        state = self.shared.step
        if state is not None and state.fits(len(tables), batch, heads, columns, storage.device):
            return state
        bs = self.shared.block_size
        width = -(-(max(t.num_slots for t in tables) + WIDTH_HEADROOM) // bs)
        visible = max(int(t.kept.max()) + t.num_slots - t.tail_start for t in tables)
        splits = 1
        if storage.device.type == "cuda":
            from lmcompact.kernels.paged_attention import decode_splits

            splits = decode_splits(batch, heads, self.shared.head_dim, visible, storage.device)
        return DecodeState.build(len(tables), batch, heads, width, storage.device, splits)

    def compact_now(self) -> KeepPlan:
        """Plan and apply the policy to the prompt held now (normally automatic)."""
        if self.observer is None:
            raise ValueError("this PagedCache has no policy; pass policy= to compact")
        storage = self.shared.storage
        if storage is None:
            raise RuntimeError("nothing to compact: the cache is empty")
        before = self.shared.pool.num_used
        self.last_plan = compact_layers(self.paged_layers, self.observer, self.shared.pool, storage)
        logger.info(
            "compacted %s: %d -> %d blocks in use",
            self.observer.policy.name,
            before,
            self.shared.pool.num_used,
        )
        return self.last_plan

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Permute every layer's rows by ``beam_idx`` (beam search; block ids move, K/V stay).

        The indices come to the host once per step (a device sync on CUDA,
        which ``generate`` pays anyway), not once per layer, and the reference
        counts of all layers move in one pass.
        """
        rows = beam_idx.to(device="cpu", dtype=torch.int64)
        if torch.equal(rows, torch.arange(rows.numel())):
            return
        tables = [layer.table for layer in self.paged_layers if layer.table is not None]
        BlockTable.reorder_all(tables, rows, self.pool)
        for layer in self.paged_layers:
            if layer.kept_positions is not None:
                layer.kept_positions = layer.kept_positions[rows]

    def reset(self) -> None:
        """Give every block back to the pool and forget any pending compaction."""
        super().reset()
        if self.observer is not None:
            self.observer.layers.clear()
            self.observer.pending = False

    # ----------------------------------------------------------------- queries
    @property
    def paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    @property
    def pool(self) -> BlockPool:
        return self.shared.pool

    @property
    def spec(self) -> StorageSpec | None:
        storage = self.shared.storage
        return storage.spec if storage is not None else None

    def kv_bytes(self, blocks: int | None = None) -> int:
        """Bytes of K/V (scales included) in ``blocks`` blocks (default: in use now)."""
        spec = self.spec
        if spec is None:
            return 0
        return (self.pool.num_used if blocks is None else blocks) * spec.bytes_per_block

    def peak_kv_bytes(self) -> int:
        """K/V bytes of the most blocks ever in use at once."""
        return self.kv_bytes(self.pool.peak_used)

    def expected_refcounts(self) -> torch.Tensor:
        """``(num_blocks,)`` references recounted from every layer's block table."""
        counts = torch.zeros(self.pool.num_blocks, dtype=torch.int64)
        for layer in self.paged_layers:
            if layer.table is not None and layer.table.blocks.numel():
                ids = layer.table.blocks.reshape(-1)
                counts.index_add_(0, ids, torch.ones_like(ids))
        return counts

    def check_accounting(self) -> None:
        """Raise unless pool counts equal the tables' references exactly."""
        self.pool.check_counts(self.expected_refcounts())
