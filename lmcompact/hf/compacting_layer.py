"""One model layer of :class:`~lmcompact.hf.cache.CompactingCache`.

Dense K/V ``(B, H, T, D)`` during the prefill, a :class:`RaggedLayer` (per-head lengths)
after the cache compacts. :meth:`CompactingLayer.attend` is this layer's attention (SDPA
during the prefill, the ragged reference attention during decode). As with transformers'
own layers, a layer knows nothing of its cache: the cache calls :meth:`update` and
:meth:`attend`, records what the policy reads (:attr:`observations`) and decides when
to compact.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from lmcompact.attention.reference import ragged_attention
from lmcompact.hf.attention import causal_sdpa
from lmcompact.layout.ragged import RaggedLayer
from lmcompact.policies import LayerObservation


class CompactingLayer(CacheLayerMixin):
    """One model layer's KV: dense during prefill, ragged per head afterwards.

    Args:
        layer_idx: The model layer.
        key_mass: Decode attention also returns the mass each kept key got
            (:attr:`last_mass`; decode-time policies re-plan from it).
        accumulate: The key mass of every decode step adds to the ragged scores (H2O).
        window: Decode queries kept (:attr:`recent_queries`) for policies that score the
            cache by the attention of the last ``window`` generated tokens; 0 keeps none.

    Attributes:
        seen: Tokens this layer has seen (kept or not): the next token's position.
        ragged: The compacted K/V, None before compaction.
        sliding_window: The layer's window as transformers last passed it (None: full
            attention); keys it has slid past are dropped at every (re-)plan.
        observations: One per row: what the prefill forward observed for the policy
            (set by the cache; None before the prefill and after compaction).
        last_mass: ``(N,)`` ragged-ordered key mass of the last decode step, or None.
        recent_queries: ``(B, Hq, <= window, D)`` post-RoPE queries of the last decode
            steps, or None; their positions in :attr:`recent_positions` ``(<= window,)``.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(
        self, layer_idx: int, *, key_mass: bool = False, accumulate: bool = False, window: int = 0
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.key_mass = key_mass
        self.accumulate = accumulate
        self.window = window
        self.recent_queries: torch.Tensor | None = None
        self.recent_positions: torch.Tensor | None = None
        self.seen = 0
        self.ragged: RaggedLayer | None = None
        self.sliding_window: int | None = None
        self.observations: list[LayerObservation] | None = None
        self.query_positions: torch.Tensor | None = None
        self.last_mass: torch.Tensor | None = None

    # ----------------------------------------------------------- transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V ``(B, H, S, D)``; returns them (the new tokens only)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, _, s, _ = key_states.shape
        positions = torch.arange(self.seen, self.seen + s, device=key_states.device)
        self.query_positions = positions.expand(b, s)
        if self.ragged is None:
            if self.keys is not None:
                raise ValueError(
                    "CompactingCache compacts at the end of the first forward; a second "
                    "forward before compaction (chunked prefill) is not supported"
                )
            self.keys, self.values = key_states, value_states
        else:
            self.ragged = self.ragged.append(key_states, value_states, self.query_positions)
        self.seen += s
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.ragged = None
        self.observations = None
        self.last_mass = None
        self.recent_queries = self.recent_positions = None
        self.seen = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("CompactingCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("CompactingCache cannot be cropped (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("CompactingCache does not support num_return_sequences > 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("CompactingCache does not support batch selection")

    # ------------------------------------------------------------- attention
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention output ``(B, S, Hq, D)`` for this layer's current forward."""
        self.sliding_window = kwargs.get("sliding_window")
        if self.ragged is None:
            return causal_sdpa(module, query, key, value, scaling, **kwargs)
        assert self.query_positions is not None
        out, mass = ragged_attention(
            query,
            self.ragged,
            self.query_positions,
            scale=scaling,
            return_key_mass=self.key_mass,
            window=kwargs.get("sliding_window"),
        )
        if mass is not None:
            self.last_mass = mass
            if self.accumulate:
                self.ragged.accumulate_scores(mass)
        if self.window:
            self._keep_queries(query, self.query_positions[0])
        return out.transpose(1, 2).contiguous()

    def first_visible(self) -> int | None:
        """The oldest position the next query can attend to on a sliding-window layer
        (older keys are never read again); None on a full-attention layer."""
        if self.sliding_window is None:
            return None
        return max(0, self.seen - int(self.sliding_window) + 1)

    def _keep_queries(self, query: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep the last ``window`` decode queries ``(B, Hq, S, D)`` and their positions."""
        if self.recent_queries is not None and self.recent_positions is not None:
            query = torch.cat([self.recent_queries, query.detach()], dim=2)
            positions = torch.cat([self.recent_positions, positions])
        self.recent_queries = query.detach()[:, :, -self.window :]
        self.recent_positions = positions[-self.window :]

    def nbytes(self) -> int:
        """Bytes this layer holds now (dense K/V before compaction, ragged after)."""
        if self.ragged is not None:
            return self.ragged.nbytes()
        if self.keys is None or self.values is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))
