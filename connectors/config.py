"""Connector options: parsed from ``kv_connector_extra_config`` and validated at start-up.

Example ``--kv-transfer-config``::

    {"kv_connector": "LMCompactConnector",
     "kv_connector_module_path": "connectors.lmcompact_connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"policy": "snapkv", "budget": 0.5, "chunk_size": 256,
                                   "tiers": ["cpu", "redis"], "cpu_capacity_mb": 2048,
                                   "redis_url": "redis://127.0.0.1:6379/0"}}

Engine-dependent checks (chunk size versus block size, prefix caching with a compacting
policy, policy shape) run in :func:`validate_against_engine` once the engine is known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcompact.policies import (
    Budget,
    CompactionInputs,
    CompactionPolicy,
    LayerObservation,
    Need,
    make_policy,
)
from lmcompact.store import StoreConfig

TIERS = ("cpu", "redis")
CUDA_GRAPHS = ("piecewise", "full")
"""Values of ``cuda_graphs`` (see :class:`ConnectorConfig`)."""

COMPACT_ON = ("save", "load")
UNSUPPORTED_NEEDS = Need.CUMULATIVE_SCORES | Need.TOKEN_CLASSES
BUDGET_TOLERANCE = 0.1
"""A budget is honoured when the kept fraction (whole blocks) is within 10% of it, relative."""


def kept_blocks(budget: float, blocks: int) -> int:
    """Whole blocks kept of ``blocks`` at kept fraction ``budget``: the nearest, >= 1."""
    return min(blocks, max(1, round(budget * blocks)))


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


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector options.

    Attributes:
        policy: compaction policy name (``lmcompact policies`` lists them); ``"none"`` stores
            the full KV and is exact.
        policy_params: the policy's hyper-parameters besides the budget.
        budget: kept fraction per chunk, in (0, 1]; kept as whole KV blocks, so the engine
            refuses a budget the chunk's block count cannot honour within 10% (the error
            names the possible values).
        chunk_size: tokens per stored chunk; a multiple of the engine's block size.
        window: observation-window queries (the prompt's last ``window`` tokens) captured for
            score-based policies (and Expected Attention's query statistics); ``kvzip``
            also captures its own sample of queries across the prompt.
        tiers: store tiers, fastest first, from ``("cpu", "redis")``.
        cpu_capacity_mb: CPU tier size in MiB.
        redis_url: ``redis://host:port/db`` when ``"redis"`` is a tier.
        redis_ttl_s: lifetime of Redis entries; None keeps them until Redis evicts.
        save: store compacted prefixes of finished prefills.
        load: serve stored prefixes to new requests.
        async_save: compact and store on a background thread (the forward pass only waits
            for a page copy); False does it inline (deterministic, slower).
        model_id: name that enters the store namespace; None uses the engine's model path.
        compact_on: when the policy runs on a stored prefix. ``"save"``: chunks are compacted
            when they are saved (the observation window is the end of the saving prompt) and
            stored compacted. ``"load"``: chunks are stored whole (the namespace of policy
            ``none``, never mixed with compacted entries) and the loading request's own
            prefill packs them in place with the policy, its window being that request's
            tail (its question); needs :class:`LMCompactMemoryConnector` with a compacting
            ``memory.prefill`` mode.
        cuda_graphs: how compacted requests run under CUDA graphs. ``"piecewise"`` (the
            default): the connector asks vLLM for piecewise graphs and cuts holes out of
            the attention metadata inside each attention call (checked on the H200).
            ``"full"``: vLLM keeps its full decode graphs and the connector cuts holes in
            the runner's input buffers (vLLM 0.26's V2 GPU runner; experimental: not yet
            checked on a GPU, see docs/benchmarks/serve-h200.md).
    """

    policy: str = "none"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    budget: float = 0.5
    chunk_size: int = 256
    window: int = 32
    tiers: tuple[str, ...] = ("cpu",)
    cpu_capacity_mb: int = 1024
    redis_url: str | None = None
    redis_ttl_s: float | None = None
    save: bool = True
    load: bool = True
    async_save: bool = True
    model_id: str | None = None
    compact_on: str = "save"
    cuda_graphs: str = "piecewise"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; ValueError names the bad key or value."""
        extra = dict(extra or {})
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - allowed)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; allowed: {sorted(allowed)}"
            )
        if "tiers" in extra:
            tiers = extra["tiers"]
            if isinstance(tiers, str):
                tiers = [t.strip() for t in tiers.split(",") if t.strip()]
            extra["tiers"] = tuple(tiers)
        config = cls(**extra)
        config.validate()
        return config

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(
            isinstance(self.policy, str) and bool(self.policy),
            f"policy must be a policy name, got {self.policy!r}",
        )
        need(
            isinstance(self.policy_params, Mapping),
            f"policy_params must be a mapping, got {self.policy_params!r}",
        )
        need(
            not isinstance(self.budget, bool)
            and isinstance(self.budget, (int, float))
            and 0.0 < float(self.budget) <= 1.0,
            f"budget must be a kept fraction in (0, 1], got {self.budget!r}",
        )
        need(
            isinstance(self.chunk_size, int) and self.chunk_size > 0,
            f"chunk_size must be a positive int (a multiple of the block size), "
            f"got {self.chunk_size!r}",
        )
        need(
            isinstance(self.window, int) and self.window >= 0,
            f"window must be an int >= 0, got {self.window!r}",
        )
        need(
            bool(self.tiers)
            and all(t in TIERS for t in self.tiers)
            and len(set(self.tiers)) == len(self.tiers),
            f"tiers must be a non-empty list of distinct names from {list(TIERS)}, "
            f"got {list(self.tiers)!r}",
        )
        need(
            isinstance(self.cpu_capacity_mb, int) and self.cpu_capacity_mb > 0,
            f"cpu_capacity_mb must be a positive int, got {self.cpu_capacity_mb!r}",
        )
        need(
            ("redis" in self.tiers) == (self.redis_url is not None),
            f"redis_url must be set exactly when 'redis' is a tier; tiers={list(self.tiers)}, "
            f"redis_url={self.redis_url!r}",
        )
        for name in ("save", "load", "async_save"):
            need(
                isinstance(getattr(self, name), bool),
                f"{name} must be true or false, got {getattr(self, name)!r}",
            )
        need(
            self.compact_on in COMPACT_ON,
            f"compact_on must be one of {list(COMPACT_ON)}, got {self.compact_on!r}",
        )
        need(
            self.cuda_graphs in CUDA_GRAPHS,
            f"cuda_graphs must be one of {list(CUDA_GRAPHS)}, got {self.cuda_graphs!r}",
        )
        self.make_policy()  # unknown policy or bad parameters raise here
        self.store_config()

    # ------------------------------------------------------------------ derived
    @property
    def compacts(self) -> bool:
        """True when stored chunks may hold fewer tokens than they cover."""
        return self.policy != "none" and float(self.budget) < 1.0

    @property
    def store_compacts(self) -> bool:
        """True when the store holds compacted chunks (``compact_on`` ``"save"``)."""
        return self.compacts and self.compact_on == "save"

    def make_policy(self) -> CompactionPolicy:
        params = dict(self.policy_params)
        if "budget" in params:
            raise ValueError("give the budget as the top-level 'budget' option, not a policy_param")
        if self.policy != "none":
            params["budget"] = Budget(ratio=float(self.budget))
        return make_policy(self.policy, **params)

    def store_policy(self) -> CompactionPolicy:
        """The policy applied when chunks are saved: ``none`` unless they are stored
        compacted."""
        return self.make_policy() if self.store_compacts else make_policy("none")

    @property
    def store_policy_name(self) -> str:
        return self.policy if self.store_compacts else "none"

    def namespace_params(self) -> dict[str, Any]:
        """Policy identity that enters the store namespace (plain JSON data); whole chunks
        (policy ``none``, or ``compact_on`` ``"load"``) share one namespace."""
        if not self.store_compacts:
            return {"budget": 1.0}
        params = dict(self.policy_params)
        params["budget"] = float(self.budget)
        return params

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            cpu_capacity_bytes=self.cpu_capacity_mb << 20 if "cpu" in self.tiers else None,
            redis_url=self.redis_url if "redis" in self.tiers else None,
            redis_ttl_s=self.redis_ttl_s,
        )

    def kept_per_chunk(self, block_size: int) -> int:
        """Tokens each (layer, head) keeps of one stored chunk: the budget in whole blocks
        (>= 1); the whole chunk when chunks are stored uncompacted.

        :func:`validate_against_engine` refuses a budget this rounding would change by more
        than :data:`BUDGET_TOLERANCE` (when the store path is on).
        """
        if not self.store_compacts:
            return self.chunk_size
        return kept_blocks(float(self.budget), self.chunk_size // block_size) * block_size


def validate_against_engine(
    config: ConnectorConfig,
    *,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    per_head_counts: bool = False,
) -> None:
    """Checks that need the engine: ValueError with the bad value and what is allowed.

    A compacting policy must (1) keep the same number of tokens in every (layer, head),
    because attention skips one block-aligned hole per request (unless ``per_head_counts``:
    the memory connector's ``per_head`` option pads and masks), and (2) need only inputs
    the connector captures. vLLM's prefix caching may stay on: compacted blocks are kept
    out of its cache (:class:`connectors.memory.blocks.PrefixCacheGuard`).
    """
    if config.chunk_size % block_size:
        allowed = ", ".join(str(block_size * k) for k in (2, 4, 8, 16))
        raise ValueError(
            f"chunk_size {config.chunk_size} must be a multiple of the engine block size "
            f"{block_size} (e.g. {allowed})"
        )
    if not config.compacts:
        return
    if config.store_compacts and (config.save or config.load):
        # chunks stored whole (compact_on "load") are packed per prompt, checked there
        check_budget_geometry(float(config.budget), config.chunk_size, block_size)
    policy = config.make_policy()
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
    if per_head_counts:
        return
    # the count the policy must honour per chunk, whether it runs at save or at load
    kept = dataclasses.replace(config, compact_on="save").kept_per_chunk(block_size)
    plan = policy.plan(probe_inputs(config, policy, num_layers, num_kv_heads, head_dim, kept))
    counts = plan.kept_counts()
    if not bool((counts == kept).all()):
        raise ValueError(
            f"policy {config.policy!r} keeps different numbers of tokens per head or layer, or "
            f"not the asked number (min {int(counts.min())}, max {int(counts.max())}, asked "
            f"{kept} per chunk); the "
            "vLLM connector needs the same count everywhere (attention skips one "
            "block-aligned hole per request). Uniform policies: none, streaming_llm, snapkv, "
            "knorm, tova, random, kvzip, expected_attention; per-head policies run with "
            "LMCompactMemoryConnector's "
            'memory option "per_head"'
        )


def probe_inputs(
    config: ConnectorConfig,
    policy: CompactionPolicy,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kept: int,
) -> CompactionInputs:
    """Synthetic inputs of the engine's shape, to check a policy's plan shape at start-up."""
    gen = torch.Generator().manual_seed(0)
    t = config.chunk_size
    window = max(1, min(config.window, t))
    layers = []
    for _ in range(num_layers):
        keys = torch.randn(num_kv_heads, t, head_dim, generator=gen)
        scores = torch.rand(num_kv_heads, t, generator=gen)
        attention = torch.rand(num_kv_heads, window, t, generator=gen)
        layers.append(
            LayerObservation(
                keys=keys,
                values=torch.randn_like(keys),
                window_scores=scores,
                window_attention=attention,
                context_scores=torch.rand(num_kv_heads, t, generator=gen),
                window_queries=torch.randn(num_kv_heads, window, head_dim, generator=gen),
            )
        )
    return CompactionInputs(
        t,
        num_kv_heads,
        layers,
        budget_tokens=kept,
        query_positions=torch.arange(t, t + window),
    )
