"""Connector options: parsed from ``kv_connector_extra_config`` and validated at start-up.

Example ``--kv-transfer-config``::

    {"kv_connector": "LMCompactConnector",
     "kv_connector_module_path": "lmcompact.vllm.connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {
         "policy": "snapkv", "budget": 0.5,
         "store": {"chunk_size": 256, "tiers": ["cpu", "redis"], "cpu_capacity_mb": 2048,
                   "redis_url": "redis://127.0.0.1:6379/0"},
         "release": {"prefill": "pack", "decode_budget_tokens": 512}}}

Three groups: the policy (top level: ``policy``, ``budget``, ``policy_params``, ``window``,
``cuda_graphs``), ``store`` (:class:`StoreOptions`: compacted prefixes saved to and loaded
from the tiers; ``"store": false`` turns it off) and ``release`` (:class:`ReleaseOptions`:
prompts packed in place and their dropped blocks given back to vLLM; off unless given). Any
combination works. Old spellings still accepted: the store options at the top level, and
``"memory"`` for ``"release"`` (one deprecation line in the log).

Engine-dependent checks (chunk size versus block size, budget geometry, policy shape) run in
:func:`lmcompact.vllm.engine_checks.validate_against_engine` once the engine is known.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcompact.policies import Budget, CompactionPolicy, Need, make_policy
from lmcompact.store import StoreConfig
from lmcompact.vllm.memory.config import (
    MEMORY_KEY,
    RELEASE_KEY,
    ReleaseOptions,
    per_head_slack,
)
from lmcompact.vllm.memory.planner import PrefillMode
from lmcompact.vllm.options import (
    boolean,
    choice,
    integer,
    mapping,
    names,
    number,
    option,
    parse,
    text,
)

logger = logging.getLogger(__name__)

EXTRA = "kv_connector_extra_config"
STORE_KEY = "store"
TIERS = ("cpu", "redis")
CUDA_GRAPHS = ("piecewise", "full")
"""Values of ``cuda_graphs`` (see :class:`ConnectorConfig`)."""

POLICY_DEFAULTS: dict[str, dict[str, Any]] = {
    "snapkv": {"kernel_size": 15},
    "expected_attention": {"share": True, "kernel_size": 15},
}
"""The connector's defaults for a policy's hyper-parameters where they differ from the
policy class's own (the paper's); ``policy_params`` override them key by key.

snapkv's max-pool width is 15 here (SnapKV's paper and kvpress: 7). Measured through this
connector (``lmcompact eval --engine vllm --tasks multi_needle``, budget 0.25, 15 questions
per cell, ``docs/eval/RESULTS.md``): kernel 15 kept the full cache's accuracy in all 8 cells
(SmolLM2-135M and Gemma-3-270m, 2k and 4k, ``compact_on: load`` and in place) and in the 3
cells of the single-fact ``needle`` task in place; kernel 7 lost a question in place on
Gemma-3 at 2k and at 4k and on Gemma's 2k needle (a 5-digit answer with a digit dropped: a
pool of 7 around a peak inside the number does not cover the number and the words before
it).

expected_attention keeps one token set for every (layer, head) here (``share``), the
tokens a global top-k over every (layer, head, token) of a chunk picks in the most heads
(:mod:`lmcompact.policies.allocation`), max-pooled over 15 tokens: the store holds one count
per (layer, head) and chunk, and per-head choices under that count dropped digits of the
numbers (SmolLM2 2k ``multi_needle``, save path: 5 / 1 of 15 at 0.5 / 0.25 against 1-2 / 0
per head and kvpress's 4 / 0; Gemma-3-270m 2k 4 / 1; ``docs/eval/RESULTS.md``). kvzip keeps
the class defaults (per head): ``{"allocation": "global", "share": true, "kernel_size": 15}``
with the reconstruction request kept 8 / 5 of 15 on SmolLM2 2k (the mean-score shared set
13 / 7, kvpress's ``KVzipPress`` 15 / 15), 10 / 10 on Gemma 2k and 11 / 6 on SmolLM2 4k, and
lost a question the per-head single pass kept on
``tests/integration/vllm/test_agnostic_store.py``'s context: an option, not the default."""

COMPACT_ON = ("save", "load")
PACK_UNSUPPORTED = Need.CONTEXT_SCORES | Need.WINDOW_QUERIES
"""Inputs the in-place pack (:func:`lmcompact.vllm.memory.packing.plan_pack`) does not compute."""

BUDGET_TOLERANCE = 0.1
"""A budget is honoured when the kept fraction (whole blocks) is within 10% of it, relative."""


def kept_blocks(budget: float, blocks: int) -> int:
    """Whole blocks kept of ``blocks`` at kept fraction ``budget``: the nearest, >= 1."""
    return min(blocks, max(1, round(budget * blocks)))


@dataclass(frozen=True)
class StoreOptions:
    """The ``"store"`` group: compacted prefixes saved to and loaded from the tiers.

    Attributes:
        chunk_size: tokens per stored chunk; a multiple of the engine's block size.
        tiers: store tiers, fastest first, from ``("cpu", "redis")`` (a comma list works).
        cpu_capacity_mb: CPU tier size in MiB.
        redis_url: ``redis://host:port/db`` when ``"redis"`` is a tier.
        redis_ttl_s: lifetime of Redis entries; None keeps them until Redis evicts.
        save: store compacted prefixes of finished prefills.
        load: serve stored prefixes to new requests.
        async_save: compact and store on a background thread (the forward pass only waits
            for a page copy); False does it inline (deterministic, slower).
        max_pending_save_mb: most MiB of page copies waiting for the background thread;
            a save that would pass it is skipped (counted in ``saves_skipped``, warned
            about, its chunks reported unsaved: a later request recomputes them) rather
            than letting host memory grow without bound when prompts arrive faster than
            they are compacted.
        model_id: name that enters the store namespace; None uses the engine's model path.
        compact_on: when the policy runs on a stored prefix. ``"save"``: chunks are compacted
            when they are saved (the observation window is the end of the saving prompt) and
            stored compacted. ``"load"``: chunks are stored whole (the namespace of policy
            ``none``, never mixed with compacted entries) and the loading request's own
            prefill packs them in place with the policy, its window being that request's
            tail (its question); needs the ``"release"`` group with a compacting
            ``prefill`` mode.
        per_head: ``{"slack": s}`` (s >= 1, default 3; with ``compact_on`` ``"save"``):
            stored chunks keep the policy's own count per (layer, head) (kvzip's ``allocation``
            ``"ragged"``, Ada-KV, PyramidKV, DuoAttention), each at most ``R = ceil(K x s)``
            of a chunk's C tokens (whole blocks, below C), K per (layer, head) on average.
            The store holds the ragged rows (bytes at the budget); a load packs each
            head's rows first and pads it to ``n x R`` slots, masked per head inside
            attention (:mod:`lmcompact.vllm.memory.perhead_attention`), so a loaded request
            holds ``R / C`` of its prefix's blocks, not ``K / C``. None: one count K.
    """

    chunk_size: int = option(
        256, integer(1, allowed="a positive int (a multiple of the block size)")
    )
    tiers: tuple[str, ...] = option(("cpu",), names(TIERS))
    cpu_capacity_mb: int = option(1024, integer(1))
    redis_url: str | None = option(None, text(nullable=True, allowed="a redis:// URL"))
    redis_ttl_s: float | None = option(None, number(above=0, nullable=True, allowed="seconds > 0"))
    save: bool = option(True, boolean())
    load: bool = option(True, boolean())
    async_save: bool = option(True, boolean())
    max_pending_save_mb: int = option(8192, integer(1))
    model_id: str | None = option(None, text(nullable=True))
    compact_on: str = option("save", choice(COMPACT_ON))
    per_head: Mapping[str, Any] | None = option(
        None, mapping(nullable=True, allowed='an object like {"slack": 3}')
    )

    def __post_init__(self) -> None:
        self.per_head_slack()  # raises on a bad per_head object
        if ("redis" in self.tiers) != (self.redis_url is not None):
            raise ValueError(
                f"redis_url must be set exactly when 'redis' is a tier; "
                f"tiers={list(self.tiers)}, redis_url={self.redis_url!r}"
            )

    def per_head_slack(self) -> float | None:
        """Slack of per-head stored counts, None when every (layer, head) keeps K. Default 3:
        kvzip's ragged counts kept every multi_needle answer at 0.25 with 3, lost most with
        2 or 1.5 (docs/eval/RESULTS.md, "KVzip with per-head stored counts")."""
        return per_head_slack(self.per_head, f"{STORE_KEY}.per_head", default=3.0)

    @property
    def enabled(self) -> bool:
        """Whether the store path runs at all (saves or loads)."""
        return self.save or self.load

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            cpu_capacity_bytes=self.cpu_capacity_mb << 20 if "cpu" in self.tiers else None,
            redis_url=self.redis_url if "redis" in self.tiers else None,
            redis_ttl_s=self.redis_ttl_s,
        )


STORE_OPTIONS = frozenset(f.name for f in dataclasses.fields(StoreOptions))


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector options: the policy, and the ``store`` and ``release`` groups.

    Attributes:
        policy: compaction policy name (``lmcompact policies`` lists them); ``"none"`` stores
            the full KV and is exact.
        policy_params: the policy's hyper-parameters besides the budget; unset ones take
            :data:`POLICY_DEFAULTS` (snapkv: ``kernel_size`` 15), then the policy's own.
        budget: kept fraction, in (0, 1]; kept as whole KV blocks, so the engine refuses a
            budget a stored chunk's block count cannot honour within 10% (the error names
            the possible values).
        window: observation-window queries (the prompt's last ``window`` tokens) captured for
            score-based policies (and Expected Attention's query statistics); ``kvzip``
            also captures its own sample of queries across the prompt.
        cuda_graphs: how compacted requests run under CUDA graphs. ``"piecewise"`` (the
            default): the connector asks vLLM for piecewise graphs and cuts holes out of
            the attention metadata inside each attention call (checked on the H200).
            ``"full"``: vLLM keeps its full decode graphs and the connector cuts holes in
            the runner's input buffers (vLLM 0.26's V2 GPU runner; checked on the H200,
            faster: docs/benchmarks/serve-h200.md). Not the default because vLLM asks for
            the graph mode before the model is known: sliding-window models need piecewise
            graphs (refused with a message); per-head counts and H2O decode get them.
        store: the ``"store"`` group (:class:`StoreOptions`).
        release: the ``"release"`` group (:class:`ReleaseOptions`), None when off.
    """

    policy: str = option("none", text(allowed="a policy name"))
    policy_params: Mapping[str, Any] = option(None, mapping(), factory=dict)
    budget: float = option(0.5, number(above=0, at_most=1, allowed="a kept fraction in (0, 1]"))
    window: int = option(32, integer(0))
    cuda_graphs: str = option("piecewise", choice(CUDA_GRAPHS))
    store: StoreOptions = dataclasses.field(default_factory=StoreOptions)
    release: ReleaseOptions | None = None

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any] | None, *, release: bool = False
    ) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; ValueError names the bad key or value.

        Args:
            extra: the user's options (groups, or the old flat spelling).
            release: whether the release group is on when the options do not say
                (``LMCompactMemoryConnector``, the old name, turns it on).
        """
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"{EXTRA} must be an object, got {extra!r}")
        top = dict(extra or {})
        store = _store_group(top)
        group = _release_group(top, release)
        config = parse(cls, top, EXTRA, store=store, release=group)
        return config

    def __post_init__(self) -> None:
        """Checks that relate the policy and the groups (none needs the engine)."""
        policy = self.make_policy()  # unknown policy or bad parameters raise here
        load_packs = self.compacts and self.store.compact_on == "load"
        if self.store.per_head is not None:
            if not self.store_compacts:
                raise ValueError(
                    f"{STORE_KEY}.per_head stores per-head counts of compacted chunks: it needs "
                    "a compacting policy, a budget below 1 and compact_on 'save'"
                )
            if self.release is not None and self.release.per_head is not None:
                raise ValueError(
                    f"{STORE_KEY}.per_head and the release group's per_head together are not "
                    "supported; choose one"
                )
        if self.release is None:
            if load_packs:
                raise ValueError(
                    "compact_on 'load' stores prefixes whole and compacts them in the loading "
                    "request's prefill, but the connector packs prompts in place only with a "
                    '"release" group; add "release": {"prefill": "auto"}'
                )
            return
        mode = self.release_mode
        g = self.release.group
        if load_packs and mode is PrefillMode.OFF:
            raise ValueError(
                "compact_on 'load' stores prefixes whole and compacts them in the loading "
                f"request's prefill: {g}.prefill must be 'pack', 'blocks' or 'auto', got 'off'"
            )
        unpackable = policy.needs & PACK_UNSUPPORTED
        if self.compacts and mode is PrefillMode.PACK and unpackable:
            raise ValueError(
                f"policy {self.policy!r} needs {unpackable}, which the in-place pack does not "
                "compute (it scores with keys and the window's attention, the question being "
                "inside the observation window); use it on the store path (compact_on 'save', "
                f"{g}.prefill 'off') or pack with snapkv, knorm, tova, streaming_llm"
            )

    # ------------------------------------------------------------------ derived
    @property
    def release_mode(self) -> PrefillMode:
        """What the release group does when a prefill ends (OFF without the group)."""
        if self.release is None:
            return PrefillMode.OFF
        return self.release.prefill_mode(self.policy, self.compacts)

    @property
    def per_head_counts(self) -> bool:
        """Whether (layer, head) counts may differ (``release.per_head`` or
        ``store.per_head``: padding masked)."""
        release = self.release is not None and self.release.per_head is not None
        return release or self.store.per_head is not None

    @property
    def needs_piecewise(self) -> bool:
        """Whether vLLM must run piecewise CUDA graphs (see ``cuda_graphs``)."""
        return (
            self.cuda_graphs != "full"
            or self.store.per_head is not None  # the per-head recompute runs in decode too
            or (self.release is not None and self.release.needs_piecewise)
        )

    @property
    def compacts(self) -> bool:
        """True when the policy drops tokens (stored chunks, or packed prompts)."""
        return self.policy != "none" and float(self.budget) < 1.0

    @property
    def store_compacts(self) -> bool:
        """True when the store holds compacted chunks (``compact_on`` ``"save"``)."""
        return self.compacts and self.store.compact_on == "save"

    @property
    def effective_params(self) -> dict[str, Any]:
        """``policy_params`` over the connector's :data:`POLICY_DEFAULTS` for the policy."""
        return {**POLICY_DEFAULTS.get(self.policy, {}), **self.policy_params}

    def make_policy(self) -> CompactionPolicy:
        params = self.effective_params
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
        params = self.effective_params
        params["budget"] = float(self.budget)
        slack = self.store.per_head_slack()
        if slack is not None:  # ragged chunks, capped by the slack: their own namespace
            params["per_head_slack"] = slack
        return params

    def kept_per_chunk(self, block_size: int) -> int:
        """Tokens each (layer, head) keeps of one stored chunk: the budget in whole blocks
        (>= 1); the whole chunk when chunks are stored uncompacted.

        :func:`lmcompact.vllm.engine_checks.validate_against_engine` refuses a budget this
        rounding would change by more than :data:`BUDGET_TOLERANCE` (when the store path is
        on).
        """
        chunk = self.store.chunk_size
        if not self.store_compacts:
            return chunk
        return kept_blocks(float(self.budget), chunk // block_size) * block_size

    def slots_per_chunk(self, block_size: int) -> int:
        """Slots one loaded chunk takes in a request's block row: K, or with
        ``store.per_head`` the per-head cap ``R = ceil(K x slack)`` in whole blocks, at
        most ``C - 1`` block (a chunk must leave a hole: attention masks the padding only
        in rows that have one)."""
        kept = self.kept_per_chunk(block_size)
        slack = self.store.per_head_slack()
        if slack is None or not self.store_compacts:
            return kept
        chunk = self.store.chunk_size
        blocks = -(-math.ceil(kept * slack - 1e-9) // block_size)
        return max(kept, min(blocks * block_size, chunk - block_size))


def _store_group(top: dict[str, Any]) -> StoreOptions:
    """Pop the store options from ``top``: the ``"store"`` group, or (old spelling) the
    store keys at the top level; ``"store": false`` keeps the store path off."""
    flat = {key: top.pop(key) for key in sorted(STORE_OPTIONS & set(top))}
    if STORE_KEY not in top:
        return parse(StoreOptions, flat, STORE_KEY)
    group = top.pop(STORE_KEY)
    if flat:
        raise ValueError(
            f'{sorted(flat)} given both at the top level and with a "store" group: give the '
            'store options inside "store" only'
        )
    if group is False:
        return StoreOptions(save=False, load=False)
    if group is True or group is None:
        return StoreOptions()
    if not isinstance(group, Mapping):
        raise ValueError(f"{EXTRA}.store must be an object, true or false, got {group!r}")
    return parse(StoreOptions, group, STORE_KEY, prefix="store.")


def _release_group(top: dict[str, Any], default: bool) -> ReleaseOptions | None:
    """Pop the ``"release"`` group (or the old ``"memory"``) from ``top``; None when off."""
    if RELEASE_KEY in top and MEMORY_KEY in top:
        raise ValueError(f'give "{RELEASE_KEY}" only ("{MEMORY_KEY}" is its old name), not both')
    key = MEMORY_KEY if MEMORY_KEY in top else RELEASE_KEY
    if key not in top:
        return ReleaseOptions() if default else None
    if key == MEMORY_KEY:
        _log_deprecated(MEMORY_KEY, RELEASE_KEY)
    group = top.pop(key)
    if group is False or (group is None and not default):
        return None
    if group is True or group is None:
        return ReleaseOptions(group=key)
    if not isinstance(group, Mapping):
        raise ValueError(f"{EXTRA}.{key} must be an object, true or false, got {group!r}")
    return parse(ReleaseOptions, group, key, prefix=f"{key}.", group=key)


@functools.cache
def _log_deprecated(old: str, new: str) -> None:
    """One deprecation line per process and spelling."""
    logger.warning(
        '%s "%s" is the old name of the "%s" option group; it still works for this release',
        EXTRA,
        old,
        new,
    )
