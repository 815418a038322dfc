"""The connector's spec: options, engine facts, the policy and the store namespaces, once.

:meth:`ConnectorSpec.build` parses ``kv_connector_extra_config``, reads the engine's facts,
builds the policy and names every tensor-parallel rank's store namespace, and runs every
start-up check that needs the engine (``ValueError`` with the bad value and what is
allowed). A process builds one spec per engine configuration: the scheduler and the worker
connector of an in-process engine share it, and everything else reads it.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from connectors.vllm.config import (
    BUDGET_TOLERANCE,
    ConnectorConfig,
    kept_blocks,
)
from connectors.vllm.disaggregation import KV_BOTH, check_role, options_for_role
from connectors.vllm.kv_dtype import fp8_store_defaults, refuse_fp8_combinations
from connectors.vllm.patches import engine
from lmcompact.compaction.hole_planner import HolePlanner, PrefillMode
from lmcompact.compaction.policy_inputs import probe_inputs
from lmcompact.policies import CompactionPolicy, Need
from lmcompact.store import StoreNamespace

logger = logging.getLogger(__name__)

STORE_LAYOUT = "lmcompact-rows-v1"
"""Stored chunks are per-head rows, independent of any engine page layout."""

UNSUPPORTED_NEEDS = Need.CUMULATIVE_SCORES | Need.TOKEN_CLASSES
"""Inputs the connector never captures (policies needing them are refused)."""


@dataclass(frozen=True)
class ConnectorSpec:
    """Everything the connector's halves read about their configuration.

    Attributes:
        config: the parsed options.
        facts: the engine's KV-cache shape (one rank's heads).
        policy: the policy of in-place packs and compacting saves (built once).
        store_policy: what saved chunks are compacted with (``policy``, or ``none`` when
            the store holds whole chunks).
        namespaces: every tensor-parallel rank's store namespace (rank 0's also derives the
            chunk keys).
        max_model_len: the engine's longest sequence.
        kept: tokens each (layer, head) keeps of one stored chunk.
        slots: slots one loaded chunk takes in a block row (``kept``, or with per-head
            counts ``ceil(kept x layer_slack)`` in whole blocks).
        cap: with ``store.per_head``, most tokens one (layer, head) keeps of a chunk; None
            without.
        kv_role: vLLM's ``kv_role`` (:mod:`connectors.vllm.disaggregation`).
    """

    config: ConnectorConfig
    facts: engine.EngineFacts
    policy: CompactionPolicy
    store_policy: CompactionPolicy
    namespaces: tuple[StoreNamespace, ...]
    max_model_len: int
    kept: int
    slots: int
    cap: int | None = None
    kv_role: str = KV_BOTH

    @classmethod
    def build(cls, vllm_config: Any) -> ConnectorSpec:
        """The spec of ``vllm_config`` (built and checked once per process and config)."""
        facts = engine.engine_facts(vllm_config)
        role = engine.kv_role(vllm_config)
        extra = options_for_role(engine.transfer_extra_config(vllm_config), role)
        extra = fp8_store_defaults(extra, facts)
        max_len = int(vllm_config.model_config.max_model_len)
        key = (json.dumps(extra, sort_keys=True, default=str), facts, max_len, role)
        with _LOCK:
            spec = _SPECS.get(key)
            if spec is None:
                config = ConnectorConfig.from_extra(extra)
                spec = cls.from_parts(config, facts, max_len, kv_role=role)
                _SPECS[key] = spec
        return spec

    @classmethod
    def from_parts(
        cls,
        config: ConnectorConfig,
        facts: engine.EngineFacts,
        max_model_len: int,
        kv_role: str = KV_BOTH,
    ) -> ConnectorSpec:
        """Check ``config`` against the engine and build the spec (no caching)."""
        policy = config.policy_object
        check_role(config, kv_role)
        check_against_engine(config, policy, facts)
        refuse_fp8_combinations(config, facts)
        if config.release is not None:
            refuse_under_tensor_parallel(config, facts.tp_size)
        spec = cls(
            config=config,
            facts=facts,
            policy=policy,
            store_policy=config.store_policy_object,
            namespaces=tuple(build_namespace(config, facts, rank) for rank in range(facts.tp_size)),
            max_model_len=max_model_len,
            kept=config.kept_per_chunk(facts.block_size),
            slots=config.slots_per_chunk(facts.block_size),
            cap=config.head_cap_per_chunk(facts.block_size),
            kv_role=kv_role,
        )
        if config.release is not None:
            spec.log_pack_geometry(spec.planner())
        warn_query_aware_store(config)
        return spec

    def planner(self, holes: Any = None) -> HolePlanner:
        """The release group's hole geometry; ``holes`` is where its holes live (the
        scheduler's request records), None for a worker that only reads the geometry."""
        release = self.config.release
        if release is None:
            raise ValueError('the hole planner needs the "release" group')
        bs = self.facts.block_size
        return HolePlanner(
            block_size=bs,
            prefill_mode=self.config.release_mode,
            budget=float(self.config.budget),
            sink_blocks=release.sink_blocks,
            decode_budget_blocks=release.decode_budget_blocks(bs),
            min_prompt_blocks=max(2, release.min_prompt_tokens // bs),
            per_head_slack=release.per_head_slack(),
            per_head_layer_slack=release.per_head_layer_slack() or 1.0,
            decode_recent_blocks=release.decode_recent_blocks(bs),
            holes=holes,
            protect_prompt=release.protect_prompt,
        )

    def log_pack_geometry(self, planner: HolePlanner) -> None:
        """Say for which prompt lengths in-place packs honour the budget (whole blocks)."""
        if planner.prefill_mode is not PrefillMode.PACK:
            return
        honoured = pack_budget_honoured_from(planner, self.max_model_len)
        logger.info(
            "in-place packs keep whole blocks of %d tokens: budget %g is kept within %.0f%% "
            "for prompts of >= %s tokens; other lengths keep the nearest block count "
            "(each pack logs its kept / full tokens)",
            planner.block_size,
            planner.budget,
            100 * BUDGET_TOLERANCE,
            "no length up to max_model_len: only some" if honoured is None else honoured,
        )


_SPECS: dict[tuple[str, engine.EngineFacts, int, str], ConnectorSpec] = {}
"""The process's specs (configuration objects, never per-step state)."""
_LOCK = threading.Lock()


QUERY_AWARE = Need.WINDOW_SCORES | Need.WINDOW_ATTENTION
"""What a query-aware selection reads: the attention of the prompt's last queries."""


def warn_query_aware_store(config: ConnectorConfig) -> None:
    """A stored prefix is selected before any question exists: a policy that scores tokens by
    the saving prompt's last queries keeps what that prompt's end attended to, and the
    questions of later requests lose their answers. Say so once, naming what to use."""
    if config.store.compact_on != "save" or not config.store_compacts or not config.store.save:
        return
    policy = config.store_policy_object
    if not policy.needs & QUERY_AWARE or Need.CONTEXT_SCORES in policy.needs:
        return
    logger.warning(
        "policy %r selects stored prefixes by the attention of the saving prompt's last "
        "queries, before later requests ask their questions (query-aware). For stored "
        'prefixes use "store": {"compact_on": "both"} (a query-agnostic store selection, '
        "packed to the budget by each loading request with its question in the window) or "
        '"compact_on": "load" (whole chunks, packed at load), both with a "release" group; '
        "or a query-agnostic policy (expected_attention, kvzip)",
        config.policy,
    )


def build_namespace(
    config: ConnectorConfig, facts: engine.EngineFacts, tp_rank: int = 0
) -> StoreNamespace:
    """The store namespace of ``tp_rank``'s slices."""
    params = config.namespace_params()
    if config.store_compacts and facts.sliding_window is not None:
        # sliding-window layers store each chunk's most recent rows
        # (lmcompact/compaction/holes.py); chunks stored before that must not load as if
        # they did
        params["sliding_rows"] = "recent"
    return StoreNamespace(
        model_id=config.store.model_id or facts.model_id,
        kv_dtype=str(facts.page_element_dtype).removeprefix("torch."),
        kv_layout=STORE_LAYOUT,
        tp_rank=tp_rank,
        tp_world_size=facts.tp_size,
        policy_name=config.store_policy_name,
        policy_params=params,
    )


# ------------------------------------------------------------------ start-up checks
def honours(budget: float, blocks: int) -> bool:
    """Whether keeping whole blocks of ``blocks`` can honour ``budget`` (within tolerance)."""
    return abs(kept_blocks(budget, blocks) / blocks - budget) <= BUDGET_TOLERANCE * budget


def check_budget_geometry(budget: float, chunk_size: int, block_size: int) -> None:
    """ValueError naming the possible budgets when whole blocks cannot honour ``budget``.

    A chunk of ``chunk_size / block_size`` blocks keeps a whole number of them, so the
    kept fraction moves in steps of one block: with block 128 and chunk 256 only 0.5 and 1
    exist, and 0.25 or 0.1 would silently keep half.
    """
    blocks = chunk_size // block_size
    if honours(budget, blocks):
        return
    possible = [k / blocks for k in range(1, blocks + 1)]
    nearest = min(possible, key=lambda f: abs(f - budget))
    shown = ", ".join(f"{f:g}" for f in possible[:8]) + (", ..." if blocks > 8 else "")
    larger = next((m for m in range(blocks + 1, 64 * blocks + 1) if honours(budget, m)), None)
    hint = (
        f"; or chunk_size {larger * block_size} ({larger} blocks) keeps "
        f"{kept_blocks(budget, larger) / larger:g}"
        if larger is not None
        else ""
    )
    raise ValueError(
        f"budget {budget:g} cannot be honoured with chunk_size {chunk_size} and block size "
        f"{block_size}: a chunk of {blocks} block(s) keeps whole blocks, so the possible "
        f"budgets are {shown} (the nearest, {nearest:g}, is more than "
        f"{BUDGET_TOLERANCE:.0%} away); set budget to one of them{hint}"
    )


def check_against_engine(
    config: ConnectorConfig, policy: CompactionPolicy, facts: engine.EngineFacts
) -> None:
    """Checks that need the engine: ValueError with the bad value and what is allowed.

    A compacting policy must (1) keep the same number of tokens in every (layer, head),
    because attention skips one block-aligned hole per request (unless per-head counts:
    ``release.per_head`` and ``store.per_head`` pad and mask), and (2) need only inputs
    the connector captures. vLLM's prefix caching may stay on: compacted blocks are kept
    out of its cache (:class:`connectors.vllm.patches.kv_cache_manager.PrefixCacheGuard`).
    """
    block_size = facts.block_size
    chunk = config.store.chunk_size
    if chunk % block_size:
        allowed = ", ".join(str(block_size * k) for k in (2, 4, 8, 16))
        raise ValueError(
            f"chunk_size {chunk} must be a multiple of the engine block size "
            f"{block_size} (e.g. {allowed})"
        )
    if not config.compacts:
        return
    if config.store_compacts and config.store.enabled and not config.derived_store_budget:
        # chunks stored whole (compact_on "load") are packed per prompt, checked there
        check_budget_geometry(config.store_budget, chunk, block_size)
    missing = policy.needs & UNSUPPORTED_NEEDS
    if missing:
        raise ValueError(
            f"policy {config.policy!r} needs {missing}, which the vLLM connector does not "
            "capture (it sees the observation window's queries and the keys/values); "
            "allowed: policies needing KEYS, WINDOW_SCORES, WINDOW_ATTENTION, WINDOW_QUERIES "
            "or CONTEXT_SCORES"
        )
    if policy.needs & (Need.WINDOW_QUERIES | Need.WINDOW_SCORES | Need.WINDOW_ATTENTION) and (
        config.window < 1
    ):
        raise ValueError(
            f"policy {config.policy!r} reads the observation window's queries; window must be "
            f">= 1 (default 32), got {config.window}"
        )
    if config.per_head_counts:
        return
    # the count each policy must honour per chunk, whether it runs at save or at load
    checked = [(config.policy, policy, float(config.budget))]
    if config.two_stage:
        store_kept = config.kept_per_chunk(block_size) / chunk
        checked.append((config.store_policy_name, config.store_policy_object, store_kept))
    for name, each, budget in checked:
        kept = kept_blocks(budget, chunk // block_size) * block_size
        _check_uniform(name, each, chunk, kept, config.window, facts)


def _check_uniform(
    name: str,
    policy: CompactionPolicy,
    chunk: int,
    kept: int,
    window: int,
    facts: engine.EngineFacts,
) -> None:
    """ValueError unless ``policy`` keeps ``kept`` of a chunk's tokens in every (layer, head)."""
    inputs = probe_inputs(
        chunk,
        window,
        facts.num_layers,
        facts.num_kv_heads,
        facts.head_dim,
        kept,
        torch.Generator().manual_seed(0),
    )
    counts = policy.plan(inputs).kept_counts()
    if not bool((counts == kept).all()):
        raise ValueError(
            f"policy {name!r} keeps different numbers of tokens per head or layer, or "
            f"not the asked number (min {int(counts.min())}, max {int(counts.max())}, asked "
            f"{kept} per chunk); the "
            "vLLM connector needs the same count everywhere (attention skips one "
            "block-aligned hole per request). Uniform policies: none, streaming_llm, snapkv, "
            "knorm, tova, random, kvzip, expected_attention; per-head policies run with "
            'the "release" option "per_head" (in place) or the "store" option "per_head"'
        )


def refuse_under_tensor_parallel(config: ConnectorConfig, tp_size: int) -> None:
    """Start-up refusal of the release modes not made exact per tensor-parallel rank.

    Per-head counts are allocated over the heads a worker sees (a rank sees only its
    slice, so the allocation and the padded length would differ from one GPU's), and H2O
    decode merges were never checked across ranks; both are refused rather than run
    unverified. Uniform policies are per rank by construction: every (layer, head) keeps
    the same count, so one block table serves all ranks.
    """
    release = config.release
    if tp_size == 1 or release is None:
        return
    refused = []
    if release.per_head is not None:
        refused.append("release.per_head (per-head counts)")
    if release.merges:
        refused.append(f"release.decode_policy {release.decode_policy!r}")
    if refused:
        raise ValueError(
            f"{' and '.join(refused)} with tensor_parallel_size {tp_size}: "
            "not supported under tensor parallelism (each rank sees only its KV heads); "
            "use a uniform policy without per_head and decode_policy 'recent', or "
            "tensor_parallel_size 1"
        )


def pack_budget_honoured_from(planner: HolePlanner, max_model_len: int) -> int | None:
    """Prompt tokens from which every in-place pack keeps ``planner.budget`` within
    :data:`connectors.vllm.config.BUDGET_TOLERANCE` (None: only some lengths do).

    Packs keep whole blocks (``planner.kept_blocks``), so a prompt of ``F`` full blocks
    keeps about ``round(budget * F)``; short prompts cannot honour small budgets.

    Raises:
        ValueError: no prompt length up to ``max_model_len`` honours the budget.
    """
    budget, bs = planner.budget, planner.block_size
    lengths = range(planner.min_prompt_blocks, max_model_len // bs + 1)
    fine = [
        abs(planner.kept_blocks(nb) / nb - budget) <= BUDGET_TOLERANCE * budget for nb in lengths
    ]
    if not any(fine):
        largest = max(lengths.stop - 1, 1)
        raise ValueError(
            f"budget {budget:g} cannot be honoured by in-place packs of prompts up to "
            f"max_model_len {max_model_len} with block size {bs}: they keep whole blocks "
            f"(at best {planner.kept_blocks(largest)} of {largest}, "
            f"{planner.kept_blocks(largest) / largest:g}); raise the budget to at least "
            f"{1 / largest:g} or use a smaller block size"
        )
    if not fine[-1]:
        return None
    first = len(fine) - 1
    while first > 0 and fine[first - 1]:
        first -= 1
    return (lengths.start + first) * bs


__all__ = ["STORE_LAYOUT", "ConnectorSpec", "build_namespace"]
