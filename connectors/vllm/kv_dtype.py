"""What the connector does with fp8 KV caches (``kv_cache_dtype`` fp8, fp8_e4m3, fp8_e5m2).

Supported: in-place packs (``release``), stored prefixes saved and loaded (whole or
compacted, any policy of one count per (layer, head)), two-stage loads, models with
sliding-window layers. Their bytes move untouched and scores read the numbers the bytes
decode to (:mod:`lmcompact.compaction.kv_quant`). ``store.quantize`` "auto" becomes none:
the rows are fp8 already.

Refused at start-up, each naming the combination: paths that compute attention or scores
inside attention layers from cached K/V (per-head counts, decode policies other than
"recent": H2O, window-scored ones), a named ``store.quantize``, and a store with KV scales
other than 1.0 (stored bytes carry no scales, so an engine with other scales would read
other numbers).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from connectors.vllm.config import AUTO, STORE_KEY, ConnectorConfig
from connectors.vllm.patches import engine
from lmcompact.compaction.kv_quant import Fp8Pages

logger = logging.getLogger(__name__)


def fp8_store_defaults(extra: Mapping[str, Any], facts: engine.EngineFacts) -> dict[str, Any]:
    """``extra`` with ``store.quantize`` "auto" made null on an fp8 cache: the stored rows
    are the cache's fp8 bytes already (half of bf16, as int8 rows are), so the default
    quantization is skipped; a named ``store.quantize`` stays and is refused."""
    top = dict(extra)
    group = top.get(STORE_KEY)
    if not facts.fp8 or group is False:
        return top
    store = dict(group) if isinstance(group, Mapping) else {}
    if store.get("quantize", AUTO) != AUTO:
        return top
    logger.info("fp8 KV cache: stored chunks keep its fp8 bytes (store.quantize auto: none)")
    top[STORE_KEY] = {**store, "quantize": None}
    return top


def refuse_fp8_combinations(config: ConnectorConfig, facts: engine.EngineFacts) -> None:
    """Start-up check of the options against an fp8 KV cache (ValueError naming them)."""
    if not facts.fp8:
        return
    refused = []
    release = config.release
    if release is not None and release.per_head is not None:
        refused.append("release.per_head (per-head counts)")
    if config.store.per_head is not None:
        refused.append("store.per_head (per-head counts)")
    if release is not None and release.decode_policy != "recent":
        refused.append(f"release.decode_policy {release.decode_policy!r}")
    if config.store.enabled and config.store.quantize is not None:
        refused.append(f"store.quantize {config.store.quantize!r} (the rows are fp8 already)")
    if refused:
        raise ValueError(
            f"kv_cache_dtype {facts.kv_cache_dtype!r} cannot be combined with "
            f"{' and '.join(refused)} in LMCompactConnector; supported with fp8 KV caches: "
            "uniform policies in place (release) and stored prefixes (store), or use "
            "kv_cache_dtype 'auto'"
        )


def refuse_fp8_scales(
    config: ConnectorConfig, pages: Fp8Pages | None, calculated_scales: bool
) -> None:
    """Worker start-up: stored fp8 bytes mean the same numbers only under the same scales.

    Args:
        config: the options.
        pages: the layers' fp8 pages with their scales now, None for other caches.
        calculated_scales: vLLM's ``calculate_kv_scales`` is on (scales set later).
    """
    if pages is None or not config.store.enabled:
        return
    if calculated_scales:
        raise ValueError(
            "calculate_kv_scales with an fp8 KV cache and the store: the scales are set by "
            "the first batches, and stored fp8 bytes carry none; turn calculate_kv_scales "
            'off, or the store off ("store": {"save": false, "load": false})'
        )
    if not pages.unit_scales:
        raise ValueError(
            f"the store with an fp8 KV cache needs KV scales of 1.0, found key scales "
            f"{sorted(set(pages.k_scales))[:4]} and value scales "
            f"{sorted(set(pages.v_scales))[:4]}: stored fp8 bytes carry no scales; turn the "
            'store off ("store": {"save": false, "load": false}) or use kv_cache_dtype "auto"'
        )
