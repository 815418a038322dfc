"""A transformers ``Cache`` that compacts itself with any lmcompact policy.

Usage (Llama-family models; batches without padding)::

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    enable_lmcompact_attention(model)
    cache = CompactingCache(model, "snapkv", budget=0.25)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    cache.nbytes(), cache.full_nbytes()   # bytes held vs. a full cache

Life of one layer (the cache drives; its layers never call it)::

    prefill forward  update(): the layer keeps dense K/V (B, H, T, D); the keys go back
                               tagged with the cache's attention for that layer
                     attend(): the layer's causal SDPA over the prompt; the cache
                               observes the queries -> window / cumulative / context
                               scores (lmcompact.compaction.policy_inputs)
    last layer done  compact(): policy.plan() per sequence -> RaggedLayer per layer
                               (dense K/V dropped: the bytes are really gone)
    decode forward   update(): append new K/V to every (sequence, head) segment
                     attend(): the layer's ragged reference attention (per-head
                               lengths), key mass -> decode-time scores
    after last layer decode-time policies re-plan a layer whose longest head grew
                     past its post-prefill size + ``decode_slack``

Logical positions never change (RoPE stays right): ``get_seq_length`` counts
every token seen, kept or not.

The layer is :mod:`lmcompact.hf.compacting_layer`; what the policy is given (prefill plan,
decode re-plan) is :mod:`lmcompact.hf.cache_plans`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from lmcompact.compaction.policy_inputs import (
    joined_positions,
    prompt_observations,
    window_positions,
)
from lmcompact.hf.attention import ATTN_IMPLEMENTATION, tag
from lmcompact.hf.cache_plans import prefill_plans, replan_layer, tail_window
from lmcompact.hf.compacting_layer import CompactingLayer
from lmcompact.hf.observe import TokenClassifier, flat_scores_for, rope_from_model
from lmcompact.layout.ragged import ragged_from_dense
from lmcompact.plan import KeepPlan
from lmcompact.policies.base import CompactionPolicy, Need, Phase
from lmcompact.policies.registry import make_policy

__all__ = ["DEFAULT_WINDOW", "CompactingCache", "CompactingLayer"]

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 32


class CompactingCache(Cache):
    """transformers ``Cache`` whose layers apply an lmcompact policy.

    Args:
        model: A Llama-family model switched to ``"lmcompact"`` attention
            (:func:`~lmcompact.hf.attention.enable_lmcompact_attention`).
        policy: A policy instance or a registered name.
        budget: Budget for a policy given by name (ratio or tokens); None keeps
            the policy's default.
        window_size: Observation window ``W``; default the policy's own
            ``window_size`` if it has one, else 32.
        decode_slack: Decode-time policies re-plan a layer once its longest head
            exceeds its post-prefill size by this many tokens (amortizes the cost;
            0 re-plans every step); None: ``interval - 1`` for a policy with an
            ``interval`` (every ``interval`` generated tokens), else 16.
        decode_compaction: Whether decode-time policies run during generation.
        decode_budget: Tokens per (layer, head) that decode-time policies re-plan back to
            (a decode budget, as vLLM's ``release.decode_budget_tokens``); None: each
            layer's longest head after the prefill compaction.
        protect_prompt: With ``decode_budget``: the prompt's tokens kept by the prefill
            compaction all stay, and the budget bounds the generated tokens only (as
            vLLM's release group holds a request's kept prompt blocks plus its decode
            budget); False: the budget bounds prompt and generated tokens together.
        tokenizer: Needed by policies that read token classes (FastGen).
        **policy_params: Hyper-parameters for a policy given by name.
    """

    def __init__(
        self,
        model: Any,
        policy: CompactionPolicy | str = "none",
        *,
        budget: float | int | str | None = None,
        window_size: int | None = None,
        decode_slack: int | None = None,
        decode_compaction: bool = True,
        decode_budget: int | None = None,
        protect_prompt: bool = False,
        tokenizer: Any = None,
        auto_compact: bool = True,
        **policy_params: Any,
    ) -> None:
        config = model.config.get_text_config()
        if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"the model uses {model.config._attn_implementation!r} attention; call "
                "lmcompact.hf.enable_lmcompact_attention(model) first"
            )
        if isinstance(policy, str):
            if budget is not None:
                policy_params["budget"] = budget
            policy = make_policy(policy, **policy_params)
        elif budget is not None or policy_params:
            raise ValueError("budget and policy parameters go with a policy name, not an instance")
        self.policy = policy
        self.model = model
        self.tokenizer = tokenizer
        self.auto_compact = auto_compact
        self.needs: Need = policy.needs
        self.num_layers = int(config.num_hidden_layers)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        own_window = getattr(policy, "window_size", None)
        self.window_size = int(window_size or own_window or DEFAULT_WINDOW)
        if self.window_size <= 0:
            raise ValueError(f"window_size must be > 0, got {self.window_size}")
        if decode_slack is None:
            interval = getattr(policy, "interval", None)
            decode_slack = 16 if interval is None else int(interval) - 1
        if decode_slack < 0:
            raise ValueError(f"decode_slack must be >= 0, got {decode_slack}")
        self.decode_slack = decode_slack
        if decode_budget is not None and decode_budget < 1:
            raise ValueError(f"decode_budget must be >= 1 token, got {decode_budget}")
        self.decode_budget = decode_budget
        if protect_prompt and decode_budget is None:
            raise ValueError("protect_prompt needs a decode_budget (it bounds generated tokens)")
        self.protect_prompt = protect_prompt
        self.prompt_length: int | None = None
        self._prompt_kept: torch.Tensor | None = None  # (B, L, H) prompt tokens kept
        self.decode_compaction = decode_compaction and Phase.DECODE in policy.phases
        self.wants_decode_mass = self.decode_compaction and bool(
            self.needs & (Need.WINDOW_SCORES | Need.WINDOW_ATTENTION | Need.CUMULATIVE_SCORES)
        )
        self.context_sampler: CompactionPolicy = policy
        if policy.scores_given:
            raise ValueError(
                f"policy {policy.name!r} reads per-token scores that the integration supplies "
                "(context_scores), not ones attention can compute here; the transformers "
                "cache has no source for them. Use it on vLLM's save path "
                "(connectors.vllm.reconstruct.store_surprisal_context for self_info)"
            )
        rotates = self.needs & (Need.WINDOW_QUERIES | Need.CONTEXT_SCORES)
        self.rope = rope_from_model(model) if rotates else None
        self.attention_scale: float | None = None
        self.classifier: TokenClassifier | None = None
        self._hook: Any = None
        self._prompt_ids: torch.Tensor | None = None
        if Need.TOKEN_CLASSES in self.needs:
            if tokenizer is None:
                raise ValueError(f"policy {policy.name!r} reads token classes: pass tokenizer=")
            self.classifier = TokenClassifier(tokenizer)
            self._hook = model.get_input_embeddings().register_forward_pre_hook(self._capture_ids)
        self.plans: list[KeepPlan] | None = None
        self.decode_targets: list[int] | None = None
        self.query_positions: torch.Tensor | None = None
        """``(W,)`` prompt positions of the recorded window queries (``WINDOW_QUERIES``)."""
        self.stats: dict[str, float] = {
            "observe_s": 0.0,
            "observe_window_s": 0.0,
            "observe_cumulative_s": 0.0,
            "observe_context_s": 0.0,
            "compact_s": 0.0,
            "decode_compact_s": 0.0,
            "decode_compactions": 0.0,
        }
        accumulate = Need.CUMULATIVE_SCORES in self.needs
        # a window of the last decode queries, for policies that score by more than one
        self.decode_window = self.window_size if self.wants_decode_mass else 0
        if self.decode_window == 1 or Need.CUMULATIVE_SCORES in self.needs:
            self.decode_window = 0  # the last step's key mass is that window
        layers: list[Any] = [
            CompactingLayer(
                i, key_mass=self.wants_decode_mass, accumulate=accumulate, window=self.decode_window
            )
            for i in range(self.num_layers)
        ]
        super().__init__(layers=layers)
        self._attention = [_LayerAttention(self, i) for i in range(self.num_layers)]

    @classmethod
    def recorder(
        cls, model: Any, tokenizer: Any = None, window_size: int = DEFAULT_WINDOW
    ) -> CompactingCache:
        """A cache that records a prefill for many policies: dense K/V plus every score.

        Use it for one prefill forward, then :meth:`fork` once per policy: each
        fork compacts from the recorded state (no second prefill; the prefill is
        identical for every policy because compaction happens after it).
        """
        cache = cls(model, "none", window_size=window_size, auto_compact=False)
        cache.needs = (
            Need.KEYS
            | Need.WINDOW_SCORES
            | Need.WINDOW_ATTENTION
            | Need.CUMULATIVE_SCORES
            | Need.CONTEXT_SCORES
            | Need.WINDOW_QUERIES
        )
        cache.context_sampler = make_policy("kvzip")  # the default sample of prompt queries
        cache.rope = rope_from_model(model)
        if tokenizer is not None:
            cache.needs |= Need.TOKEN_CLASSES
            cache.tokenizer = tokenizer
            cache.classifier = TokenClassifier(tokenizer)
            cache._hook = model.get_input_embeddings().register_forward_pre_hook(cache._capture_ids)
        return cache

    def fork(self, policy: CompactionPolicy | str, **options: Any) -> CompactingCache:
        """A new cache holding this recorder's prefill, compacted by ``policy``.

        Args:
            policy: Policy instance or name (``options`` may carry ``budget``,
                ``decode_slack`` and policy parameters, as for the constructor).

        Raises:
            ValueError: This cache has not recorded a prefill, or the policy needs
                an observation the recorder did not capture or a different window.
        """
        if self.plans is not None or any(layer.keys is None for layer in self._layers()):
            raise ValueError("fork() needs a recorder cache after exactly one prefill forward")
        new = CompactingCache(self.model, policy, tokenizer=self.tokenizer, **options)
        reads_window = bool(new.needs & (Need.WINDOW_SCORES | Need.WINDOW_ATTENTION))
        # A shorter window is the tail of the recorded per-query rows (TOVA reads one).
        shorter = new.window_size < self.window_size and Need.WINDOW_ATTENTION in self.needs
        if reads_window and new.window_size != self.window_size and not shorter:
            raise ValueError(
                f"policy window {new.window_size} differs from the recorded {self.window_size}"
            )
        missing = new.needs & ~self.needs
        if missing:
            raise ValueError(f"the recorder did not capture {missing}")
        if Need.CONTEXT_SCORES in new.needs:
            length = self._layers()[0].seen
            recorded = self.context_positions(length)
            asked = new.context_positions(length)
            same_shift = self.context_sampler.context_shift(length) == new.policy.context_shift(
                length
            )
            if (
                recorded is None
                or asked is None
                or not torch.equal(recorded, asked)
                or not same_shift
            ):
                raise ValueError(
                    f"policy {new.policy.name!r} samples other prompt queries than the "
                    "recorder's context scores (the recorder uses kvzip's defaults)"
                )
        new.rope, new.attention_scale = self.rope, self.attention_scale
        if new._hook is not None:
            new._hook.remove()
            new._hook = None
        new._prompt_ids = self._prompt_ids
        new.query_positions = self.query_positions
        for mine, theirs in zip(self._layers(), new._layers(), strict=True):
            theirs.dtype, theirs.device = mine.dtype, mine.device
            theirs.is_initialized = True
            theirs.keys, theirs.values = mine.keys, mine.values
            theirs.observations = mine.observations
            if reads_window and shorter and mine.observations is not None:
                theirs.observations = tail_window(mine.observations, new.window_size)
            theirs.seen = mine.seen
        observe = 0.0
        if reads_window:
            # billed in full even for a shorter window: an upper bound of its own cost
            observe += self.stats["observe_window_s"]
        if Need.CUMULATIVE_SCORES in new.needs:
            observe += self.stats["observe_cumulative_s"]
        if Need.CONTEXT_SCORES in new.needs:
            observe += self.stats["observe_context_s"]
        new.stats["observe_s"] = observe
        new.compact()
        return new

    # ---------------------------------------------------------------- helpers
    def context_positions(self, length: int) -> torch.Tensor | None:
        """``(S,)`` prompt positions whose queries make the context scores (or join the
        window queries), or None."""
        if not self.needs & (Need.CONTEXT_SCORES | Need.WINDOW_QUERIES):
            return None
        return self.context_sampler.context_queries(length)

    def _capture_ids(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if self._prompt_ids is None and args and isinstance(args[0], torch.Tensor):
            self._prompt_ids = args[0].detach().cpu()

    def _layers(self) -> list[CompactingLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompactingLayer)]

    def _token_masks(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per sequence, the prompt's special and punctuation masks (token classes)."""
        if self.classifier is None:
            return None
        ids = self._prompt_ids
        if ids is None or ids.shape[-1] != length:
            raise ValueError("token classes need input_ids (not inputs_embeds) in the prompt")
        return [self.classifier.masks(row) for row in ids]

    # ------------------------------------------------------------- forward
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer stores the new K/V; the keys go back tagged with this cache's
        attention for the layer (:mod:`lmcompact.hf.attention`)."""
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return tag(keys, self._attention[layer_idx]), values

    def attend(
        self,
        layer_idx: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Layer ``layer_idx``'s attention ``(B, S, Hq, D)`` for this forward.

        Prefill: the layer's SDPA, then this cache observes what its policy reads; after
        the last layer it compacts (``auto_compact``). Decode: the layer's ragged
        attention; after the last layer decode-time policies re-plan."""
        layer = self.layers[layer_idx]
        assert isinstance(layer, CompactingLayer)
        prefill = layer.ragged is None
        out = layer.attend(module, query, key, value, scaling, **kwargs)
        last = layer_idx == self.num_layers - 1
        if prefill:
            self.observe(layer, query, key, scaling)
            if last and self.auto_compact:
                self.compact()
        elif last:
            self.after_decode_step()
        return out

    def observe(
        self, layer: CompactingLayer, query: torch.Tensor, key: torch.Tensor, scaling: float
    ) -> None:
        """Record what the policy reads from one layer's prefill queries and keys."""
        length = key.shape[2]
        context = self.context_positions(length)
        # adds observe_s and its window / cumulative parts (forks bill only their own)
        layer.observations = prompt_observations(
            self.needs,
            query,
            key,
            window=self.window_size,
            scale=scaling,
            context_positions=context,
            context_shift=self.context_sampler.context_shift(length),
            rope=self.rope,
            timings=self.stats,
        )
        if Need.WINDOW_QUERIES in self.needs:
            self.query_positions = joined_positions(
                window_positions(length, self.window_size), context
            )
        self.attention_scale = scaling

    @property
    def is_compacted(self) -> bool:
        return self.plans is not None

    def nbytes(self) -> int:
        """Exact bytes held now: K, V and ragged metadata (positions, offsets, scores)."""
        return sum(layer.nbytes() for layer in self._layers())

    def full_nbytes(self) -> int:
        """Bytes a full (uncompacted) dense cache of the same tokens would hold."""
        total = 0
        for layer in self._layers():
            if self.plans is not None:
                batch = len(self.plans)
            elif layer.keys is not None:
                batch = layer.keys.shape[0]
            else:
                continue
            element = torch.empty((), dtype=layer.dtype).element_size()
            total += 2 * batch * self.num_kv_heads * layer.seen * self.head_dim * element
        return total

    def kept_ratio(self) -> float:
        """Kept fraction of the prompt's (layer, head, token) slots at the end of prefill."""
        if self.plans is None:
            return 1.0
        return sum(p.total_kept for p in self.plans) / sum(p.total_slots for p in self.plans)

    # ------------------------------------------------------------- compaction
    def compact(self) -> None:
        """End of prefill: plan every sequence and replace dense K/V with ragged K/V."""
        start = time.perf_counter()
        layers = self._layers()
        first = layers[0]
        assert first.keys is not None
        length = first.keys.shape[2]
        plans = prefill_plans(
            self.policy,
            self.needs,
            layers,
            window_size=self.window_size,
            query_positions=self.query_positions,
            token_masks=self._token_masks(length),
            rope=self.rope,
            attention_scale=self.attention_scale,
        )
        plans = [_slid_past_dropped(plan, layers) for plan in plans]
        for index, layer in enumerate(layers):
            assert layer.keys is not None and layer.values is not None
            kept = [plan.kept[index] for plan in plans]
            ragged = ragged_from_dense(layer.keys, layer.values, kept)
            observed = layer.observations or []
            cumulative = [o.cumulative_scores for o in observed if o.cumulative_scores is not None]
            if observed and len(cumulative) == len(observed):
                ragged.scores = flat_scores_for(torch.stack(cumulative), kept)
            layer.ragged = ragged
            layer.keys = layer.values = None
            layer.observations = None
        self.plans = plans
        self.prompt_length = length
        self._prompt_kept = torch.stack([p.kept_counts() for p in plans])
        everything = all(p.total_kept == p.total_slots for p in plans)
        if self.decode_compaction and self.decode_budget is not None:
            self.decode_targets = [self.decode_budget] * len(layers)
        elif self.decode_compaction and not everything:
            longest = torch.stack([p.kept_counts() for p in plans]).amax(dim=(0, 2))
            self.decode_targets = [int(n) for n in longest]
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.stats["compact_s"] += time.perf_counter() - start
        logger.debug(
            "compacted %d tokens with %s: kept %.3f of the slots",
            length,
            self.policy.name,
            self.kept_ratio(),
        )

    def after_decode_step(self) -> None:
        """Re-plan layers whose longest head outgrew its target (decode-time policies)."""
        if self.decode_targets is None:
            return
        start = time.perf_counter()
        replanned = False
        protect = self.prompt_length if self.protect_prompt else None
        for index, (layer, target) in enumerate(
            zip(self._layers(), self.decode_targets, strict=True)
        ):
            assert layer.ragged is not None
            held = layer.ragged.lengths()
            if layer.sliding_window is not None:
                # it sees its last W - 1 keys whatever the budget; more held are passed ones
                target = min(target, int(layer.sliding_window) - 1)
            elif protect is not None and self._prompt_kept is not None:
                held = held - self._prompt_kept[:, index].to(held.device)  # generated only
            if int(held.max()) > target + self.decode_slack:
                layer.ragged = replan_layer(
                    self.policy,
                    self.needs,
                    layer.ragged,
                    layer.last_mass,
                    target,
                    recent_queries=layer.recent_queries,
                    recent_positions=layer.recent_positions,
                    scale=self.attention_scale,
                    protect_before=protect,
                    first_visible=layer.first_visible(),
                    sliding_window=layer.sliding_window,
                )
                replanned = True
            layer.last_mass = None
        if replanned:
            self.stats["decode_compactions"] += 1
            self.stats["decode_compact_s"] += time.perf_counter() - start


def _slid_past_dropped(plan: KeepPlan, layers: Sequence[CompactingLayer]) -> KeepPlan:
    """``plan`` with each sliding-window layer keeping its most recent tokens, no more than
    it can still see and no more than the plan's largest head kept there: a key the window
    has passed is never attended to again, so a policy's pick of one is memory spent on
    nothing (vLLM's path does the same, :meth:`KeepPlan.with_recent`)."""
    by_count: dict[int, list[int]] = {}
    for index, layer in enumerate(layers):
        first = layer.first_visible()
        if first is None:
            continue
        largest = max(int(kept.numel()) for kept in plan.kept[index])
        count = min(largest, plan.seq_len - first)
        if count >= 1:
            by_count.setdefault(count, []).append(index)
    for count, chosen in by_count.items():  # one new plan per count, not per layer
        plan = plan.with_recent(chosen, count)
    return plan


@dataclass(frozen=True)
class _LayerAttention:
    """What a key tensor from :meth:`CompactingCache.update` is tagged with: the cache's
    attention for one layer (the attention function calls :meth:`attend`)."""

    cache: CompactingCache
    layer_idx: int

    def attend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """:meth:`CompactingCache.attend` of this layer (``module, query, key, value,
        scaling``, as :class:`~lmcompact.hf.attention.AttendingLayer` takes them)."""
        return self.cache.attend(self.layer_idx, *args, **kwargs)
