"""One model layer of :class:`~lmcompact.hf.cache.CompactingCache`.

Dense K/V ``(B, H, T, D)`` during the prefill, a :class:`RaggedLayer` (per-head lengths)
after the cache compacts; :meth:`CompactingLayer.attend` is the attention the
``"lmcompact"`` attention function calls for this layer (SDPA plus the observation
during the prefill, the ragged reference attention during decode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from lmcompact.attention.reference import ragged_attention
from lmcompact.hf.attention import causal_sdpa, tag
from lmcompact.hf.observe import PrefillObservation, observe_prefill
from lmcompact.layout.ragged import RaggedLayer
from lmcompact.policies.base import Need

if TYPE_CHECKING:
    from lmcompact.hf.cache import CompactingCache


class CompactingLayer(CacheLayerMixin):
    """One model layer's KV: dense during prefill, ragged per head afterwards."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: CompactingCache, layer_idx: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.seen = 0
        self.ragged: RaggedLayer | None = None
        self.observation: PrefillObservation | None = None
        self.query_positions: torch.Tensor | None = None
        self.last_mass: torch.Tensor | None = None

    # ----------------------------------------------------------- transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V ``(B, H, S, D)``; returns them tagged for the attention function."""
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
        return tag(key_states, self), value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.ragged = None
        self.observation = None
        self.last_mass = None
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
        owner = self.owner
        if self.ragged is None:
            out = causal_sdpa(module, query, key, value, scaling, **kwargs)
            # adds observe_s and its window / cumulative parts (forks bill only their own)
            self.observation = observe_prefill(
                query,
                key,
                owner.needs,
                owner.window_size,
                scaling,
                timings=owner.stats,
                context_positions=owner.context_positions(key.shape[2]),
                context_shift=owner.context_sampler.context_shift(key.shape[2]),
                rope=owner.rope,
            )
            owner.attention_scale = scaling
            if self.layer_idx == owner.num_layers - 1 and owner.auto_compact:
                owner.compact()
            return out
        assert self.query_positions is not None
        out, mass = ragged_attention(
            query,
            self.ragged,
            self.query_positions,
            scale=scaling,
            return_key_mass=owner.wants_decode_mass,
        )
        if mass is not None:
            self.last_mass = mass
            if Need.CUMULATIVE_SCORES in owner.needs:
                self.ragged.accumulate_scores(mass)
        if self.layer_idx == owner.num_layers - 1:
            owner.after_decode_step()
        return out.transpose(1, 2).contiguous()

    def nbytes(self) -> int:
        """Bytes this layer holds now (dense K/V before compaction, ragged after)."""
        if self.ragged is not None:
            return self.ragged.nbytes()
        if self.keys is None or self.values is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))
