"""The ``"release"`` option group: in-place packing and giving dropped blocks back to vLLM.

Example ``--kv-transfer-config``::

    {"kv_connector": "LMCompactConnector",
     "kv_connector_module_path": "lmcompact.vllm.connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {
         "policy": "snapkv", "budget": 0.25, "store": false,
         "release": {"prefill": "auto", "decode_budget_tokens": 512}}}

With ``"per_head": {"slack": 1.5}``, policies that keep different numbers of tokens per
(layer, head) (``adakv``, ``pyramidkv``, ``duoattention``) keep their own counts: see
:mod:`lmcompact.vllm.memory.perhead_attention`. The top-level ``policy`` and ``budget`` drive
the in-place compaction of fresh prefills. ``"memory"`` is the old name of this group
(``LMCompactMemoryConnector``), still accepted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcompact.vllm.memory.planner import PrefillMode
from lmcompact.vllm.options import boolean, choice, integer, mapping, option

RELEASE_KEY = "release"
MEMORY_KEY = "memory"
"""The deprecated name of the ``"release"`` group."""

PREFILL_CHOICES = ("auto", "off", "pack", "blocks")
DECODE_POLICIES = ("recent", "h2o")


@dataclass(frozen=True)
class ReleaseOptions:
    """Validated ``"release"`` options (each field's rule: :func:`lmcompact.vllm.options.parse`).

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
            mass (:mod:`lmcompact.vllm.memory.heavy_hitters`).
        decode_recent_tokens: ``h2o`` only: recent tokens kept in order after the hole when
            the hole opens during generation (block aligned); None: half the budget. The
            kept region is the rest of the budget (or the prompt's packed kept blocks).
        sink_blocks: leading blocks never dropped, >= 1.
        min_prompt_tokens: prompts shorter than this are not compacted at prefill end.
        per_head: ``{"slack": s}`` (s >= 1) keeps the policy's own count per (layer, head)
            in ``pack`` mode: every head reserves ``ceil(kept_blocks * s)`` blocks, counts
            are clipped to that; None (default) gives every head the same count.
        reserve_growth: admission without thrash (default True): a waiting request is
            admitted only when the free blocks, after its own prompt, still cover what every
            running request will yet allocate up to its ``max_tokens`` (the rest of its
            prompt, its generation; a planned hole counts as returned once packed), so
            requests admitted thanks to freed blocks are never preempted for growth
            (:meth:`lmcompact.vllm.memory.scheduler_side.MemoryScheduler.admits`).
        warm_up: compile and autotune the GPU pack kernels when the KV caches are
            registered, for every power-of-two prompt length up to ``max_model_len``, so
            the first request does not pay for it (default True; CUDA only).
        group: the key the user wrote (``"release"``, or the old ``"memory"``); errors
            name options under it. Not an option.
    """

    prefill: str = option("auto", choice(PREFILL_CHOICES))
    decode_budget_tokens: int | None = option(None, integer(1, nullable=True))
    decode_policy: str = option("recent", choice(DECODE_POLICIES))
    decode_recent_tokens: int | None = option(None, integer(1, nullable=True))
    sink_blocks: int = option(1, integer(1))
    min_prompt_tokens: int = option(0, integer(0))
    per_head: Mapping[str, Any] | None = option(
        None, mapping(nullable=True, allowed='an object like {"slack": 1.5}')
    )
    reserve_growth: bool = option(True, boolean())
    warm_up: bool = option(True, boolean())
    group: str = dataclasses.field(default=RELEASE_KEY, compare=False)

    def __post_init__(self) -> None:
        """Checks that relate several release options."""
        self.per_head_slack()  # raises on a bad per_head object
        g = self.group
        if self.decode_recent_tokens is not None and self.decode_policy != "h2o":
            raise ValueError(f"{g}.decode_recent_tokens needs decode_policy 'h2o'")
        if self.decode_policy == "h2o":
            if self.decode_budget_tokens is None:
                raise ValueError(f"{g}.decode_policy 'h2o' needs decode_budget_tokens")
            if self.per_head is not None:
                raise ValueError(
                    f"{g}.decode_policy 'h2o' with per_head counts is not supported (the "
                    "merge keeps every head's count equal)"
                )

    def per_head_slack(self) -> float | None:
        """The per-head slack, or None when every head keeps the same count."""
        return per_head_slack(self.per_head, f"{self.group}.per_head")

    @property
    def needs_piecewise(self) -> bool:
        """Per-head counts and H2O decode work inside every attention call, decode
        included, so full CUDA graphs cannot run them."""
        return self.per_head is not None or self.decode_policy == "h2o"

    def prefill_mode(self, policy: str, compacts: bool) -> PrefillMode:
        """The prefill mode for the connector's ``policy`` (``compacts``: a compacting
        policy with budget < 1)."""
        g = self.group
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
        if self.decode_policy == "h2o" and mode is PrefillMode.BLOCKS:
            raise ValueError(
                f"{g}.decode_policy 'h2o' needs a kept region, but prefill mode 'blocks' "
                "leaves only the sink blocks before the hole; use prefill 'pack' or 'off'"
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
                f"{self.group}.decode_budget_tokens={self.decode_budget_tokens} must be "
                f"a multiple of the block size {block_size}"
            )
        return self.decode_budget_tokens // block_size

    def decode_recent_blocks(self, block_size: int) -> int | None:
        """``h2o``: recent blocks after a hole opened during generation (None for
        ``recent``); ValueError when not block aligned or leaving no kept region."""
        budget = self.decode_budget_blocks(block_size)
        if self.decode_policy != "h2o" or budget is None:
            return None
        if self.decode_recent_tokens is None:
            recent = budget // 2
        elif self.decode_recent_tokens % block_size:
            raise ValueError(
                f"{self.group}.decode_recent_tokens={self.decode_recent_tokens} must be a "
                f"multiple of the block size {block_size}"
            )
        else:
            recent = self.decode_recent_tokens // block_size
        if budget - recent <= self.sink_blocks:
            raise ValueError(
                f"{self.group}.decode_recent_tokens leaves {budget - recent} block(s) of the "
                f"{budget}-block decode budget for the kept region; it needs more than the "
                f"{self.sink_blocks} sink block(s)"
            )
        return recent


def per_head_slack(
    per_head: Mapping[str, Any] | None, name: str, default: float = 1.5
) -> float | None:
    """The ``slack`` of a ``per_head`` option (``{"slack": s}``, s >= 1, else ``default``),
    or None when the option is off; ValueError names ``name`` for anything else."""
    if per_head is None:
        return None
    if not isinstance(per_head, Mapping) or set(per_head) - {"slack"}:
        raise ValueError(f'{name} must be an object like {{"slack": 1.5}}, got {per_head!r}')
    slack = per_head.get("slack", default)
    if isinstance(slack, bool) or not isinstance(slack, int | float) or not slack >= 1.0:
        raise ValueError(f"{name}.slack must be a number >= 1, got {slack!r}")
    return float(slack)
