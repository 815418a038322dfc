"""Connector options: parsed from ``kv_connector_extra_config`` and validated at start-up.

Example ``--kv-transfer-config``::

    {"kv_connector": "LMCompactConnector",
     "kv_connector_module_path": "connectors.vllm.connector",
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
combination works.

Engine-dependent checks (chunk size versus block size, budget geometry, policy shape) run in
:meth:`connectors.vllm.spec.ConnectorSpec.build` once the engine is known.

:func:`check_transfer_config` checks the options before vLLM starts (the CLI, the launcher and
the offline builder call it): vLLM builds the connector only after the engine loaded weights,
so a typo would otherwise surface only after the model loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmcompact.compaction.hole_planner import PrefillMode
from lmcompact.options import (
    Rule,
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
from lmcompact.policies import Budget, CompactionPolicy, Need, make_policy
from lmcompact.store import StoreConfig
from lmcompact.store.quant import QUANT_MODES, check_quantize

logger = logging.getLogger(__name__)

EXTRA = "kv_connector_extra_config"
STORE_KEY = "store"
RELEASE_KEY = "release"
CONNECTOR_NAME = "LMCompactConnector"
TRANSFER_FLAG = "--kv-transfer-config"
TIERS = ("cpu", "redis")
CUDA_GRAPHS = ("auto", "piecewise", "full")
"""Values of ``cuda_graphs`` (see :class:`ConnectorConfig`)."""

POLICY_DEFAULTS: dict[str, dict[str, Any]] = {
    "snapkv": {"kernel_size": 15},
    "expected_attention": {"share": True, "kernel_size": 15},
}
"""The connector's defaults for a policy's hyper-parameters where they differ from the
policy class's own (the paper's); ``policy_params`` override them key by key.

snapkv max-pools its scores over 15 tokens (SnapKV's paper and kvpress: 7), so a kept peak
inside a number brings the whole number and the words before it. expected_attention keeps
one token set for every (layer, head) (``share``): the tokens a global top-k over every
(layer, head, token) of a chunk picks in the most heads (:mod:`lmcompact.policies.allocation`),
max-pooled over 15 tokens, because the store holds one count per (layer, head) and chunk and
per-head choices under that count drop digits of numbers. kvzip keeps the class defaults
(per head); ``{"allocation": "global", "share": true, "kernel_size": 15}`` is an option.
The measurements behind each choice: ``docs/eval/RESULTS.md`` ("Defaults from more cells"
for snapkv, "KVzip and Expected Attention against kvpress" for the other two)."""

AUTO = "auto"
"""The default of ``policy``, ``store.compact_on`` and ``store.quantize``: the recommended
stored-prefix path (:func:`resolve_auto`)."""
COMPACT_ON = ("save", "load", "both")
TOKEN_SCORES = ("engine", "client")
STORE_BUDGET_FACTOR = 1.8
"""``compact_on`` ``"both"`` without ``store.budget``: the store keeps this times ``budget``
(at most all, rounded down to whole blocks, above the final budget's blocks). int8 rows with
their scales take about 0.52 of bf16, so the store then holds about ``budget`` of the full
bf16 bytes, with up to twice the tokens the loading request keeps on the GPU: its
query-aware pack chooses among them with the question in its window."""
DEFAULT_STORE_POLICY = "self_info"
"""The store's query-agnostic policy: ``compact_on`` ``"both"`` unless ``store.policy``
says, and ``compact_on`` ``"save"`` when ``policy`` is left to ``"auto"``."""
DEFAULT_PACK_POLICY = "snapkv"
"""The query-aware policy of the loading request's pack when ``policy`` is ``"auto"``."""
PACK_UNSUPPORTED = Need.CONTEXT_SCORES | Need.WINDOW_QUERIES
"""Inputs the in-place pack (:func:`lmcompact.compaction.pack.plan_pack`) does not compute."""

_BUDGET_DEFAULT = 0.5
BUDGET_TOLERANCE = 0.1
"""A budget is honoured when the kept fraction (whole blocks) is within 10% of it, relative."""


def kept_blocks(budget: float, blocks: int) -> int:
    """Whole blocks kept of ``blocks`` at kept fraction ``budget``: the nearest, >= 1."""
    return min(blocks, max(1, round(budget * blocks)))


PREFILL_CHOICES = ("auto", "off", "pack", "blocks")
DECODE_POLICIES = ("recent", "h2o")


@dataclass(frozen=True)
class ReleaseOptions:
    """Validated ``"release"`` options (each field's rule: :func:`lmcompact.options.parse`).

    Attributes:
        prefill: what happens when a prompt's prefill ends. ``"pack"`` runs the policy over
            the prompt's full blocks and packs the kept tokens into the first blocks;
            ``"blocks"`` keeps sink blocks plus the most recent blocks without copying
            (StreamingLLM at block granularity); ``"off"`` leaves prompts whole; ``"auto"``
            picks ``blocks`` for ``streaming_llm``, ``off`` for ``none``, else ``pack``.
        decode_budget_tokens: during generation, full-block tokens a request may hold
            outside its hole; a multiple of the block size; None leaves generation
            unbounded.
        decode_policy: what leaves when a request exceeds its decode budget. ``"recent"``
            (StreamingLLM): the oldest block after the hole is dropped. ``"h2o"``
            (Heavy-Hitter Oracle): that block is first merged into the request's kept
            region, where each (layer, head) keeps its highest accumulated attention
            mass (:mod:`lmcompact.compaction.heavy_hitters`). Any other name: a registered
            score policy with a decode phase (``decoding_snapkv``, ``rkv``, a custom
            one) chooses what the kept region keeps at each merge from the attention of
            the last decode queries (:mod:`lmcompact.compaction.window_merge`).
        decode_policy_params: hyper-parameters of such a decode policy (None: its
            defaults).
        decode_recent_tokens: merging decode policies only (not ``recent``): recent tokens
            kept in order after the hole when the hole opens during generation (block
            aligned); None: half the budget. The kept region is the rest of the budget (or
            the prompt's packed kept blocks).
        protect_prompt: with a decode budget, count generated tokens only: the prompt's
            full blocks kept at its prefill end (all of them with prefill ``"off"``) are
            never dropped nor merged during generation, and a request holds them plus the
            budget (what keeps a prompt's facts through a long generation,
            ``docs/eval/recall_after_generation_smollm2.md``). Needs prefill ``"off"``, or
            ``"pack"`` with decode policy ``"recent"``. False: one budget covers both.
        sink_blocks: leading blocks never dropped, >= 1.
        min_prompt_tokens: prompts shorter than this are not compacted at prefill end.
        per_head: ``{"slack": s, "layer_slack": r}`` (1 <= r <= s) keeps the policy's own
            count per (layer, head) in ``pack`` mode, each at most ``ceil(kept_blocks * s)``
            blocks' worth; a layer's heads share ``ceil(kept_blocks * r)`` blocks as dense
            cells (default r = 1: what one count per head holds), counts clipped to fit.
            None (default) gives every head the same count.
        reserve_growth: admission without thrash (default True): a waiting request is
            admitted only when the free blocks, after its own prompt, still cover what every
            running request will yet allocate up to its ``max_tokens`` (the rest of its
            prompt, its generation; a planned hole counts as returned once packed), so
            requests admitted thanks to freed blocks are never preempted for growth
            (:meth:`connectors.vllm.scheduler.Scheduler.admits`).
        warm_up: compile and autotune the GPU pack kernels when the KV caches are
            registered, for every power-of-two prompt length up to ``max_model_len``, so
            the first request does not pay for it (default True; CUDA only).
    """

    prefill: str = option("auto", choice(PREFILL_CHOICES))
    decode_budget_tokens: int | None = option(None, integer(1, nullable=True))
    decode_policy: str = option("recent", text())
    decode_policy_params: Mapping[str, Any] | None = option(None, mapping(nullable=True))
    decode_recent_tokens: int | None = option(None, integer(1, nullable=True))
    protect_prompt: bool = option(False, boolean())
    sink_blocks: int = option(1, integer(1))
    min_prompt_tokens: int = option(0, integer(0))
    per_head: Mapping[str, Any] | None = option(
        None, mapping(nullable=True, allowed='an object like {"slack": 1.5}')
    )
    reserve_growth: bool = option(True, boolean())
    warm_up: bool = option(True, boolean())

    def __post_init__(self) -> None:
        """Checks that relate several release options."""
        self.per_head_layer_slack()  # raises on a bad per_head object
        g = RELEASE_KEY
        name = self.decode_policy
        if name not in DECODE_POLICIES:
            try:
                self.decode_policy_object()
            except ValueError as error:
                raise ValueError(
                    f"{g}.decode_policy must be one of {list(DECODE_POLICIES)} or a decode "
                    f"score policy: {error}"
                ) from None
        elif self.decode_policy_params is not None:
            raise ValueError(f"{g}.decode_policy_params needs a policy name, not {name!r}")
        if self.decode_recent_tokens is not None and not self.merges:
            raise ValueError(
                f"{g}.decode_recent_tokens needs decode_policy 'h2o' or a decode score policy"
            )
        if self.protect_prompt and self.decode_budget_tokens is None:
            raise ValueError(f"{g}.protect_prompt needs decode_budget_tokens (it bounds the rest)")
        if self.merges:
            if self.decode_budget_tokens is None:
                raise ValueError(f"{g}.decode_policy {name!r} needs decode_budget_tokens")
            if self.per_head is not None:
                raise ValueError(
                    f"{g}.decode_policy {name!r} with per_head counts is not supported (the "
                    "merge keeps every head's count equal)"
                )

    @property
    def merges(self) -> bool:
        """Whether blocks leaving the decode budget are merged into the kept region."""
        return self.decode_policy != "recent"

    def decode_policy_object(self) -> Any:
        """The window-merge score policy (None for ``recent`` and ``h2o``)."""
        if self.decode_policy in DECODE_POLICIES:
            return None
        from lmcompact.compaction.window_merge import decode_policy

        return decode_policy(self.decode_policy, self.decode_policy_params)

    def per_head_slack(self) -> float | None:
        """The per-head slack, or None when every head keeps the same count."""
        return per_head_slack(self.per_head, f"{RELEASE_KEY}.per_head")

    def per_head_layer_slack(self) -> float | None:
        """The per-layer slack of per-head counts, or None when they are off."""
        return per_head_layer_slack(self.per_head, f"{RELEASE_KEY}.per_head")

    @property
    def needs_piecewise(self) -> bool:
        """H2O decode merges work inside every attention call on the host, decode included,
        so full CUDA graphs cannot run them (per-head counts can: their attention reads
        device tables, :mod:`lmcompact.compaction.per_head_tables`)."""
        return self.merges

    def prefill_mode(self, policy: str, compacts: bool) -> PrefillMode:
        """The prefill mode for the connector's ``policy`` (``compacts``: a compacting
        policy with budget < 1)."""
        g = RELEASE_KEY
        if self.prefill == "auto":
            if not compacts:
                mode = PrefillMode.OFF
            else:
                mode = PrefillMode.BLOCKS if policy == "streaming_llm" else PrefillMode.PACK
        else:
            mode = PrefillMode(self.prefill)
            if mode is not PrefillMode.OFF and not compacts:
                raise ValueError(
                    f"{g}.prefill={self.prefill!r} needs a compacting policy and a "
                    f"budget < 1, got policy {policy!r}"
                )
        if self.merges and mode is PrefillMode.BLOCKS:
            raise ValueError(
                f"{g}.decode_policy {self.decode_policy!r} needs a kept region, but prefill "
                "mode 'blocks' leaves only the sink blocks before the hole; use prefill "
                "'pack' or 'off'"
            )
        if self.protect_prompt and (
            mode is PrefillMode.BLOCKS or (mode is PrefillMode.PACK and self.merges)
        ):
            raise ValueError(
                f"{g}.protect_prompt with prefill mode {mode.value!r} and decode_policy "
                f"{self.decode_policy!r}: a request has one hole, so a 'blocks' prefill would "
                "drop the prompt's recent blocks and a merging decode after a 'pack' would "
                "merge into the prompt's kept blocks; use prefill 'off' (policy 'none'), or "
                "decode_policy 'recent' after a pack"
            )
        if self.per_head is not None and mode is not PrefillMode.PACK:
            raise ValueError(
                f"{g}.per_head needs prefill mode 'pack' (per-head counts are packed), "
                f"got {mode.value!r} for policy {policy!r}"
            )
        return mode

    def decode_budget_blocks(self, block_size: int) -> int | None:
        """The decode budget in blocks; ValueError when not block aligned."""
        if self.decode_budget_tokens is None:
            return None
        if self.decode_budget_tokens % block_size:
            raise ValueError(
                f"{RELEASE_KEY}.decode_budget_tokens={self.decode_budget_tokens} must be "
                f"a multiple of the block size {block_size}"
            )
        return self.decode_budget_tokens // block_size

    def decode_recent_blocks(self, block_size: int) -> int | None:
        """Merging decode policies: recent blocks after a hole opened during generation (None
        for ``recent``); ValueError when not block aligned or leaving no kept region."""
        budget = self.decode_budget_blocks(block_size)
        if not self.merges or budget is None:
            return None
        if self.decode_recent_tokens is None:
            recent = budget // 2
        elif self.decode_recent_tokens % block_size:
            raise ValueError(
                f"{RELEASE_KEY}.decode_recent_tokens={self.decode_recent_tokens} must be a "
                f"multiple of the block size {block_size}"
            )
        else:
            recent = self.decode_recent_tokens // block_size
        if budget - recent <= self.sink_blocks:
            raise ValueError(
                f"{RELEASE_KEY}.decode_recent_tokens leaves {budget - recent} block(s) of the "
                f"{budget}-block decode budget for the kept region; it needs more than the "
                f"{self.sink_blocks} sink block(s)"
            )
        return recent


def per_head_slack(
    per_head: Mapping[str, Any] | None, name: str, default: float = 1.5
) -> float | None:
    """The ``slack`` of a ``per_head`` option (``{"slack": s, "layer_slack": r}``, s >= 1,
    else ``default``), or None when the option is off; ValueError names ``name`` for
    anything else."""
    if per_head is None:
        return None
    if not isinstance(per_head, Mapping) or set(per_head) - {"slack", "layer_slack"}:
        raise ValueError(
            f'{name} must be an object like {{"slack": 1.5, "layer_slack": 1}}, got {per_head!r}'
        )
    slack = per_head.get("slack", default)
    if isinstance(slack, bool) or not isinstance(slack, int | float) or not slack >= 1.0:
        raise ValueError(f"{name}.slack must be a number >= 1, got {slack!r}")
    return float(slack)


def per_head_layer_slack(
    per_head: Mapping[str, Any] | None, name: str, default_slack: float = 1.5
) -> float | None:
    """The ``layer_slack`` of a ``per_head`` option (default 1: a layer's heads together keep
    the budget's count per head on average), None when the option is off.

    Dense cells make a request hold its largest layer's cells, so this, not ``slack``, sets
    the blocks held: ``r`` x the budget's. It lies in ``[1, slack]`` (no layer can need more
    than every head at its cap)."""
    slack = per_head_slack(per_head, name, default_slack)
    if slack is None or per_head is None:
        return None
    layer = per_head.get("layer_slack", 1.0)
    if isinstance(layer, bool) or not isinstance(layer, int | float) or not 1.0 <= layer <= slack:
        raise ValueError(
            f"{name}.layer_slack must be a number in [1, slack = {slack:g}], got {layer!r}"
        )
    return float(layer)


@dataclass(frozen=True)
class StoreOptions:
    """The ``"store"`` group: compacted prefixes saved to and loaded from the tiers.

    Attributes:
        chunk_size: tokens per stored chunk; a multiple of the engine's block size.
        tiers: store tiers, fastest first, from ``("cpu", "redis")`` (a comma list works).
        cpu_capacity_mb: CPU tier size in MiB.
        redis_url: ``redis://host:port/db`` when ``"redis"`` is a tier, or a cluster's seed
            nodes, ``redis+cluster://host:port[,host:port...]`` (chunks spread over its slots).
        redis_ttl_s: lifetime of Redis entries; None keeps them until Redis evicts.
        save: store compacted prefixes of finished prefills.
        load: serve stored prefixes to new requests.
        async_save: compact and store on a background thread (the forward pass only waits
            for a page copy); False does it inline (deterministic, slower).
        remote_wait_s: ``kv_role`` ``"kv_consumer"``: how long a request whose producer
            stored its prefix (:mod:`connectors.vllm.disaggregation`) waits for those chunks
            to reach the store before it loads what is there and recomputes the rest.
        max_pending_save_mb: most MiB of page copies waiting for the background thread;
            a save that would pass it is skipped (counted in ``saves_skipped``, warned
            about, its chunks reported unsaved: a later request recomputes them) rather
            than letting host memory grow without bound when prompts arrive faster than
            they are compacted.
        model_id: name that enters the store namespace; None uses the engine's model path.
        warm_up: on CUDA, allocate at start-up the pinned host buffers that saves copy
            pages into (one per layer for each power-of-two span up to a step's token
            budget: about twice one step's KV, e.g. 4 GiB for an 8B model at 16k tokens per
            step), and rehearse one save of a step's span (page gather, window-score
            kernels, copy, compaction; nothing stored), so the first requests that store do
            not pay allocations, kernel compiles or first calls inside their prefill.
        compact_on: when the policy runs on a stored prefix. ``"auto"`` (default):
            ``"both"`` when ``policy`` is ``"auto"``, the budget is below 1 and the release
            group is not turned off, else ``"save"`` (:func:`resolve_auto`). ``"save"``:
            chunks are compacted
            when they are saved (the observation window is the end of the saving prompt) and
            stored compacted. ``"load"``: chunks are stored whole (the namespace of policy
            ``none``, never mixed with compacted entries) and the loading request's own
            prefill packs them in place with the policy, its window being that request's
            tail (its question); it needs the ``"release"`` group with a compacting
            ``prefill`` mode, which it turns on with its defaults when the options do not
            name the group. ``"both"``: two stages. Chunks are stored compacted by the
            query-agnostic ``store.policy`` at ``store.budget`` (the bytes in the store);
            the loading request's prefill then packs the loaded prefix and its own tail in
            place to ``budget`` with ``policy``, whose window holds that request's question
            (the blocks on the GPU); needs the ``"release"`` group like ``"load"``.
        token_scores: where a store policy that reads token scores (``self_info``) gets
            them. ``"engine"`` (default): the worker computes each stored prompt token's
            surprisal ``-log p(token | prefix)`` from the model's own next-token
            log-probabilities during the storing request's prefill (its final hidden states
            through the LM head, in chunks), so a plain ``generate`` or OpenAI request is
            enough. ``"client"``: the storing request carries ``token_scores`` in its
            ``kv_transfer_params`` (:func:`connectors.vllm.reconstruct.store_surprisal_context`).
        budget: ``compact_on`` ``"both"`` only: the kept fraction of stored chunks, above the
            top-level ``budget``. None (default): :data:`STORE_BUDGET_FACTOR` times
            ``budget`` in whole blocks rounded down (at least one block above ``budget``).
        policy: ``compact_on`` ``"both"`` only: the policy of stored chunks; it sees no
            question, so a query-agnostic one (default ``self_info``, scored in the engine:
            ``token_scores``).
        per_head: ``{"slack": s, "layer_slack": r}`` (s >= 1, default 3; 1 <= r <= s,
            default 1; with ``compact_on`` ``"save"``): stored chunks keep the policy's own
            count per (layer, head) (kvzip's ``allocation`` ``"ragged"``, Ada-KV, PyramidKV,
            DuoAttention), each at most ``ceil(K x s)`` of a chunk's C tokens (whole blocks,
            below C), K per (layer, head) on average, and each layer's heads together at most
            ``R x H`` with ``R = floor(K x r)``. The store holds the ragged rows (bytes at the
            budget); a load of n chunks lays each layer's heads out as dense cells of ``n x R``
            slots rounded up to whole blocks (:mod:`lmcompact.compaction.per_head`), attended
            per head by the connector (:mod:`lmcompact.compaction.per_head_attention`), so a
            loaded request holds about ``R / C`` of its prefix's blocks (``K / C`` at r = 1).
            None: one count K.
        quantize: ``"int8"`` or ``"fp8"`` (float8 e4m3fn): stored rows (one token of one
            (layer, head)) are quantized with one float16 scale per 64 channels
            (:mod:`lmcompact.store.quant`). Redis values take about half the bytes of bf16
            (0.516x at head_dim 64, 128 and 256:
            ``docs/benchmarks/store-quantization-cpu.md``); the CPU tier keeps the engine
            dtype but holds the dequantized rows, so a chunk loads the same from either
            tier. Lossy: int8 errs by at most half a step (``absmax / 254`` of the 64
            channels) per value, fp8 by ``2^-4`` of the value. The quantization enters the store
            namespace, so quantized and unquantized entries are never loaded for each other.
            None: the engine dtype's bytes, exact. ``"auto"`` (default): ``"int8"`` with
            ``compact_on`` ``"both"`` (the store's looser selection in about the final
            budget's bf16 bytes), else None.
    """

    chunk_size: int = option(
        256, integer(1, allowed="a positive int (a multiple of the block size)")
    )
    tiers: tuple[str, ...] = option(("cpu",), names(TIERS))
    cpu_capacity_mb: int = option(1024, integer(1))
    redis_url: str | None = option(
        None, text(nullable=True, allowed="a redis:// or redis+cluster://host:port,... URL")
    )
    redis_ttl_s: float | None = option(None, number(above=0, nullable=True, allowed="seconds > 0"))
    save: bool = option(True, boolean())
    load: bool = option(True, boolean())
    async_save: bool = option(True, boolean())
    remote_wait_s: float = option(10.0, number(above=0, allowed="seconds > 0"))
    max_pending_save_mb: int = option(8192, integer(1))
    model_id: str | None = option(None, text(nullable=True))
    warm_up: bool = option(True, boolean())
    compact_on: str = option(AUTO, choice((AUTO, *COMPACT_ON)))
    token_scores: str = option("engine", choice(TOKEN_SCORES))
    budget: float | None = option(
        None, number(above=0, at_most=1, nullable=True, allowed="a kept fraction in (0, 1]")
    )
    policy: str | None = option(None, text(nullable=True, allowed="a policy name"))
    per_head: Mapping[str, Any] | None = option(
        None, mapping(nullable=True, allowed='an object like {"slack": 3}')
    )
    quantize: str | None = option(
        AUTO,
        Rule(
            f"one of {[AUTO, *QUANT_MODES]} or null",
            lambda v: v is None or v == AUTO or v in QUANT_MODES,
        ),
    )

    def __post_init__(self) -> None:
        self.per_head_layer_slack()  # raises on a bad per_head object
        if self.quantize != AUTO:  # fp8 needs torch's float8
            check_quantize(self.quantize, f"{STORE_KEY}.quantize")
        if self.compact_on not in ("both", AUTO) and (
            self.budget is not None or self.policy is not None
        ):
            raise ValueError(
                f'{STORE_KEY}.budget and {STORE_KEY}.policy apply to compact_on "both" (the '
                f"store's own selection), got compact_on {self.compact_on!r}"
            )
        if ("redis" in self.tiers) != (self.redis_url is not None):
            raise ValueError(
                f"redis_url must be set exactly when 'redis' is a tier; "
                f"tiers={list(self.tiers)}, redis_url={self.redis_url!r}"
            )

    def per_head_slack(self) -> float | None:
        """Slack of per-head stored counts, None when every (layer, head) keeps K. Default 3,
        the measured choice (docs/eval/RESULTS.md, "KVzip with per-head stored counts")."""
        return per_head_slack(self.per_head, f"{STORE_KEY}.per_head", default=3.0)

    def per_head_layer_slack(self) -> float | None:
        """Per-layer slack of per-head stored counts (default 1), None when they are off."""
        return per_head_layer_slack(self.per_head, f"{STORE_KEY}.per_head", default_slack=3.0)

    @property
    def enabled(self) -> bool:
        """Whether the store path runs at all (saves or loads)."""
        return self.save or self.load

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            cpu_capacity_bytes=self.cpu_capacity_mb << 20 if "cpu" in self.tiers else None,
            redis_url=self.redis_url if "redis" in self.tiers else None,
            redis_ttl_s=self.redis_ttl_s,
            quantize=None if self.quantize == AUTO else self.quantize,
        )


STORE_OPTIONS = frozenset(f.name for f in dataclasses.fields(StoreOptions))


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector options: the policy, and the ``store`` and ``release`` groups.

    Attributes:
        policy: compaction policy name (``lmcompact policies`` lists them); ``"none"`` stores
            the full KV and is exact. ``"auto"`` (default): the recommended path for where
            it runs (:func:`resolve_auto`): with ``compact_on`` ``"both"`` (its own default
            then) the store keeps a ``self_info`` selection scored in the engine and the
            loading request packs it with ``snapkv``; with ``"save"``, ``self_info``; with
            ``"load"``, ``snapkv``.
        policy_params: the policy's hyper-parameters besides the budget; unset ones take
            :data:`POLICY_DEFAULTS` (snapkv: ``kernel_size`` 15), then the policy's own.
        budget: kept fraction, in (0, 1]; kept as whole KV blocks, so the engine refuses a
            budget a stored chunk's block count cannot honour within 10% (the error names
            the possible values).
        window: observation-window queries (the prompt's last ``window`` tokens) captured for
            score-based policies (and Expected Attention's query statistics); ``kvzip``
            also captures its own sample of queries across the prompt.
        cuda_graphs: how compacted requests run under CUDA graphs. ``"full"``: vLLM keeps
            its full decode graphs and the connector cuts holes in the runner's input
            buffers (vLLM's V2 GPU runner; checked on the H200, the faster mode:
            docs/benchmarks/serve-h200.md). ``"piecewise"``: the connector asks vLLM for
            piecewise graphs and cuts holes inside each attention call. ``"auto"`` (the
            default): full where the engine allows it, decided when vLLM asks the
            connector (while it builds its config, model config included): piecewise for
            models with sliding-window layers, H2O decode merges, vLLM's V1 runner or no
            CUDA device, full otherwise; the decision is logged.
        store: the ``"store"`` group (:class:`StoreOptions`).
        release: the ``"release"`` group (:class:`ReleaseOptions`), None when off.
        step_trace: a file that gets one JSON line per engine step (its prefill tokens,
            decode rows, loads and packs) and, beside it (``.rank0``, ...), one per pack
            with its GPU time: what ``lmcompact bench itl`` reads to say which steps make
            the inter-token latency. None (the default): nothing written.
    """

    policy: str = option(AUTO, text(allowed="a policy name"))
    policy_params: Mapping[str, Any] = option(None, mapping(), factory=dict)
    budget: float = option(
        _BUDGET_DEFAULT, number(above=0, at_most=1, allowed="a kept fraction in (0, 1]")
    )
    window: int = option(32, integer(0))
    cuda_graphs: str = option("auto", choice(CUDA_GRAPHS))
    store: StoreOptions = dataclasses.field(default_factory=StoreOptions)
    release: ReleaseOptions | None = None
    step_trace: str | None = option(None, text(nullable=True, allowed="a file path"))

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; ValueError names the bad key or value."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"{EXTRA} must be an object, got {extra!r}")
        top = dict(extra or {})
        if "memory" in top:
            raise ValueError(f'{EXTRA} "memory" is now the "release" group: rename the key')
        store = _store_group(top)
        release_off = RELEASE_KEY in top and top[RELEASE_KEY] in (False, None)
        budget = top.get("budget", _BUDGET_DEFAULT)
        below_one = not isinstance(budget, (int, float)) or budget < 1  # bad ones: parse says
        top["policy"], store = resolve_auto(top.get("policy", AUTO), store, release_off, below_one)
        implied = RELEASE_KEY not in top and store.compact_on in ("load", "both")
        group = ReleaseOptions() if implied else _release_group(top)
        config = parse(cls, top, EXTRA, store=store, release=group)
        return config

    def __post_init__(self) -> None:
        """Checks that relate the policy and the groups (none needs the engine)."""
        if AUTO in (self.policy, self.store.compact_on, self.store.quantize):
            # built directly rather than by from_extra: no release group means it is off
            below_one = float(self.budget) < 1
            name, store = resolve_auto(self.policy, self.store, self.release is None, below_one)
            object.__setattr__(self, "policy", name)
            object.__setattr__(self, "store", store)
        policy = self.policy_object  # unknown policy or bad parameters raise here
        load_packs = self.compacts and self.store.compact_on in ("load", "both")
        if self.compacts and self.store.compact_on == "both":
            self._check_two_stages()
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
                    f"compact_on {self.store.compact_on!r} compacts stored prefixes in the "
                    "loading request's prefill, but the connector packs prompts in place only "
                    'with a "release" group, which "release": false turns off (leave it out: '
                    "compact_on 'load' and 'both' turn it on with its defaults)"
                )
            return
        mode = self.release_mode
        g = RELEASE_KEY
        if load_packs and mode is PrefillMode.OFF:
            raise ValueError(
                f"compact_on {self.store.compact_on!r} compacts stored prefixes in the loading "
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

    def _check_two_stages(self) -> None:
        """``compact_on`` ``"both"``: a store selection looser than the final budget, by a
        policy the save path can run, with one count per (layer, head)."""
        if self.store_budget <= float(self.budget):
            raise ValueError(
                f'compact_on "both": {STORE_KEY}.budget ({self.store_budget:g}) must be above '
                f"budget ({float(self.budget):g}): the load packs the stored selection down to "
                "budget (equal budgets: use compact_on 'save')"
            )
        if self.store.per_head is not None or (
            self.release is not None and self.release.per_head is not None
        ):
            raise ValueError('compact_on "both" keeps one count per (layer, head): drop per_head')
        store_policy = self.store_policy()  # unknown name or bad parameters raise here
        client = self.store.token_scores == "client"
        if Need.CONTEXT_SCORES in store_policy.needs and store_policy.scores_given and client:
            raise ValueError(
                f"{STORE_KEY}.policy {self.store_policy_name!r} with {STORE_KEY}.token_scores "
                '"client" scores with token_scores a client sends; compact_on "both" needs '
                'scores the engine computes (token_scores "engine")'
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
        """Whether these options need piecewise CUDA graphs whatever the model
        (``"piecewise"``, or H2O decode merges); ``"auto"`` may still choose them for the
        model (:meth:`LMCompactConnector.requires_piecewise_for_cudagraph`)."""
        return self.cuda_graphs == "piecewise" or (
            self.release is not None and self.release.needs_piecewise
        )

    @property
    def compacts(self) -> bool:
        """True when the policy drops tokens (stored chunks, or packed prompts)."""
        return self.policy != "none" and float(self.budget) < 1.0

    @property
    def store_compacts(self) -> bool:
        """True when the store holds compacted chunks (``compact_on`` ``"save"`` or
        ``"both"``)."""
        return self.compacts and self.store.compact_on in ("save", "both")

    @property
    def two_stage(self) -> bool:
        """``compact_on`` ``"both"`` with a compacting policy: stored compacted, then packed
        to ``budget`` by the loading request."""
        return self.compacts and self.store.compact_on == "both"

    @property
    def store_budget(self) -> float:
        """The kept fraction of stored chunks (nominal: ``kept_per_chunk`` rounds it to
        whole blocks)."""
        if self.store.compact_on == "both":
            if self.store.budget is None:
                return min(1.0, STORE_BUDGET_FACTOR * float(self.budget))
            return float(self.store.budget)
        return float(self.budget)

    @property
    def derived_store_budget(self) -> bool:
        """Whether the stored fraction is the default of ``compact_on`` ``"both"`` (rounded
        down to whole blocks, never refused for its rounding)."""
        return self.two_stage and self.store.budget is None

    @property
    def effective_params(self) -> dict[str, Any]:
        """``policy_params`` over the connector's :data:`POLICY_DEFAULTS` for the policy."""
        return {**POLICY_DEFAULTS.get(self.policy, {}), **self.policy_params}

    @functools.cached_property
    def policy_object(self) -> CompactionPolicy:
        """The policy these options name, built once (parsing checks it)."""
        return self.make_policy()

    def make_policy(self) -> CompactionPolicy:
        """A new policy object of these options (:attr:`policy_object` is the shared one)."""
        params = self.effective_params
        if "budget" in params:
            raise ValueError("give the budget as the top-level 'budget' option, not a policy_param")
        if self.policy != "none":
            params["budget"] = Budget(ratio=float(self.budget))
        return make_policy(self.policy, **params)

    @functools.cached_property
    def store_policy_object(self) -> CompactionPolicy:
        """What saved chunks are compacted with, built once: the policy (``"save"``), the
        store's own policy at ``store.budget`` (``"both"``), else ``none``."""
        if not self.store_compacts:
            return make_policy("none")
        if not self.two_stage:
            return self.policy_object
        return make_policy(
            self.store_policy_name,
            **POLICY_DEFAULTS.get(self.store_policy_name, {}),
            budget=Budget(ratio=self.store_budget),
        )

    def store_policy(self) -> CompactionPolicy:
        """The policy applied when chunks are saved (:attr:`store_policy_object`)."""
        return self.store_policy_object

    @property
    def store_policy_name(self) -> str:
        if not self.store_compacts:
            return "none"
        if self.two_stage:
            return self.store.policy or DEFAULT_STORE_POLICY
        return self.policy

    def namespace_params(self) -> dict[str, Any]:
        """Policy identity that enters the store namespace (plain JSON data); whole chunks
        (policy ``none``, or ``compact_on`` ``"load"``) share one namespace. A quantized
        store (``store.quantize``) adds its quantization, so its entries and unquantized
        ones never share a key (unquantized namespaces are unchanged)."""
        if not self.store_compacts:
            params: dict[str, Any] = {"budget": 1.0}
        else:
            name = self.store_policy_name
            params = (
                {**POLICY_DEFAULTS.get(name, {})} if self.two_stage else dict(self.effective_params)
            )
            params["budget"] = self.store_budget
            slack = self.store.per_head_slack()
            if slack is not None:  # ragged chunks, capped by the slacks: their own namespace
                params["per_head_slack"] = slack
                params["per_head_layer_slack"] = self.store.per_head_layer_slack()
        if self.store.quantize is not None:
            params["quantize"] = self.store.quantize
        return params

    def kept_per_chunk(self, block_size: int) -> int:
        """Tokens each (layer, head) keeps of one stored chunk: the budget in whole blocks
        (>= 1); the whole chunk when chunks are stored uncompacted.

        :func:`connectors.vllm.spec.check_against_engine` refuses a budget this
        rounding would change by more than :data:`BUDGET_TOLERANCE` (when the store path is
        on).
        """
        chunk = self.store.chunk_size
        if not self.store_compacts:
            return chunk
        blocks = chunk // block_size
        if self.derived_store_budget:
            floor = math.floor(self.store_budget * blocks + 1e-9)
            above_final = kept_blocks(float(self.budget), blocks) + 1
            return min(blocks, max(floor, above_final)) * block_size
        return kept_blocks(self.store_budget, blocks) * block_size

    def slots_per_chunk(self, block_size: int) -> int:
        """Slots one loaded chunk takes in a request's block row: K, or with
        ``store.per_head`` ``floor(K x layer_slack)`` (a chunk's layer keeps at most that many
        cells per head, :func:`lmcompact.layout.paged.dense_cells`), at most ``C - 1`` block
        (a chunk must leave a hole). Not block aligned with per-head counts: a load of ``n``
        chunks rounds ``n x slots`` up to whole blocks once (:func:`load_width`), so the
        layer slack is not rounded up to a block per chunk."""
        kept = self.kept_per_chunk(block_size)
        slack = self.store.per_head_layer_slack()
        if slack is None or not self.store_compacts:
            return kept
        rows = math.floor(kept * slack + 1e-9)
        return max(kept, min(rows, self.store.chunk_size - block_size))

    def head_cap_per_chunk(self, block_size: int) -> int | None:
        """Most tokens one (layer, head) keeps of a stored chunk with ``store.per_head``:
        ``ceil(K x slack)`` in whole blocks, at most ``C - 1`` block; None without it."""
        slack = self.store.per_head_slack()
        return None if slack is None else self._per_head_slots(block_size, slack)

    def _per_head_slots(self, block_size: int, slack: float | None) -> int:
        kept = self.kept_per_chunk(block_size)
        if slack is None or not self.store_compacts:
            return kept
        chunk = self.store.chunk_size
        blocks = -(-math.ceil(kept * slack - 1e-9) // block_size)
        return max(kept, min(blocks * block_size, chunk - block_size))


def load_width(count: int, slots: int, block_size: int) -> int:
    """Slots a load of ``count`` chunks of ``slots`` each takes in a block row, in whole
    blocks (the load's hole starts there)."""
    return -(-count * slots // block_size) * block_size


def resolve_auto(
    policy: str, store: StoreOptions, release_off: bool, below_one: bool
) -> tuple[str, StoreOptions]:
    """The policy and store options with every ``"auto"`` made concrete.

    ``store.compact_on`` ``"auto"`` is ``"both"`` when the policy is ``"auto"`` too, the
    budget is below 1 (``below_one``) and the release group is not turned off
    (``release_off``): a question-agnostic selection in the store, packed by each loading
    request with its own question (the only stage a query-aware policy can see it); a
    named policy runs where it is named to (``"save"``), the exact path of policy
    ``"none"`` included. ``policy`` ``"auto"`` is ``self_info`` on the save path and
    ``snapkv`` where a loading request packs. ``store.quantize`` ``"auto"`` is ``"int8"``
    with ``"both"`` and None otherwise.
    """
    on = store.compact_on
    if on == AUTO:
        on = "both" if policy == AUTO and below_one and not release_off else "save"
    if policy == AUTO:
        policy = DEFAULT_STORE_POLICY if on == "save" else DEFAULT_PACK_POLICY
    quantize = store.quantize
    if quantize == AUTO:
        quantize = "int8" if on == "both" else None
    if (on, quantize) == (store.compact_on, store.quantize):
        return policy, store
    return policy, dataclasses.replace(store, compact_on=on, quantize=quantize)


def _store_group(top: dict[str, Any]) -> StoreOptions:
    """Pop the ``"store"`` group from ``top``; ``"store": false`` keeps the store path off."""
    top_level = {f.name for f in dataclasses.fields(ConnectorConfig)}
    misplaced = sorted((STORE_OPTIONS - top_level) & set(top))
    if misplaced:
        raise ValueError(
            f'{misplaced} are store options: give them inside the "store" group, e.g. '
            f'{{"store": {{"{misplaced[0]}": ...}}}}'
        )
    if STORE_KEY not in top:
        return StoreOptions()
    group = top.pop(STORE_KEY)
    if group is False:
        return StoreOptions(save=False, load=False)
    if group is True or group is None:
        return StoreOptions()
    if not isinstance(group, Mapping):
        raise ValueError(f"{EXTRA}.store must be an object, true or false, got {group!r}")
    return parse(StoreOptions, group, STORE_KEY, prefix="store.")


def _release_group(top: dict[str, Any]) -> ReleaseOptions | None:
    """Pop the ``"release"`` group from ``top``; None when off."""
    if RELEASE_KEY not in top:
        return None
    group = top.pop(RELEASE_KEY)
    if group is False or group is None:
        return None
    if group is True:
        return ReleaseOptions()
    if not isinstance(group, Mapping):
        raise ValueError(f"{EXTRA}.{RELEASE_KEY} must be an object, true or false, got {group!r}")
    return parse(ReleaseOptions, group, RELEASE_KEY, prefix=f"{RELEASE_KEY}.")


# ---------------------------------------------------------------- before vLLM starts
def check_transfer_config(transfer: Mapping[str, Any] | str) -> bool:
    """Validate a ``--kv-transfer-config`` value (JSON text or a dict) before vLLM starts.

    Everything that does not need the engine (option names, types, ranges, the policy and
    its parameters) is checked; block-size and model-shape checks run when the connector is
    built. Returns True when it names this connector and its options are valid, False when
    it names another connector (left to vLLM).

    Raises:
        ValueError: bad JSON, or bad options for this connector.
    """
    if isinstance(transfer, str):
        try:
            transfer = json.loads(transfer)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{TRANSFER_FLAG} is not valid JSON: {exc}") from None
    if not isinstance(transfer, Mapping):
        raise ValueError(f"{TRANSFER_FLAG} must be a JSON object, got {transfer!r}")
    connector = transfer.get("kv_connector")
    if connector == "LMCompactMemoryConnector":
        raise ValueError(
            'kv_connector "LMCompactMemoryConnector" was removed: use "LMCompactConnector" with '
            'a "release" group in kv_connector_extra_config (e.g. "release": {"prefill": "auto"})'
        )
    if connector != CONNECTOR_NAME:
        return False
    ConnectorConfig.from_extra(transfer.get(EXTRA))
    return True


def transfer_config_arg(argv: Sequence[str]) -> str | None:
    """The value of ``--kv-transfer-config`` in a command line, or None."""
    for index, arg in enumerate(argv):
        if arg == TRANSFER_FLAG and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(TRANSFER_FLAG + "="):
            return arg.split("=", 1)[1]
    return None
