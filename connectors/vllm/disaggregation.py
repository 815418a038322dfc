"""Prefill/decode disaggregation: vLLM's ``kv_producer`` and ``kv_consumer`` roles.

A producer instance runs prefills and stores their compacted chunks in the shared store (the
Redis tier, one server or a cluster); a consumer instance loads them and decodes. Nothing
moves between the instances but the compacted chunks (through the store) and one small entry
of ``kv_transfer_params``, which a router copies from the producer's response into the
consumer's request (``examples/pd_proxy.py``)::

    client -> proxy -> producer  (max_tokens=1)  -> prefill, chunks saved to Redis
                    <- response kv_transfer_params {"lmcompact": {"stored": {...}}}
              proxy -> consumer  (the request + those params)
                       lookup in Redis; wait until the stored chunks arrive; load; decode

The entry names how many prompt tokens the producer stored (in chunks in the store, or being
saved when the producer answered) and the store namespace they were stored under. The
consumer's lookup waits (vLLM's "ask again") until that many chunks exist or
``store.remote_wait_s`` passes; then it loads what exists and recomputes the rest (counted as
``remote_wait_timeouts``). A consumer with another namespace (model, policy or store format)
ignores the entry with an error in its log: it cannot read those chunks.

Roles (``kv_role`` in ``--kv-transfer-config``):

* ``kv_both`` (default): saves and loads, no entry in responses.
* ``kv_producer``: saves and loads (a prefix it stored before is a hit for it too); each
  finished request's response carries the entry.
* ``kv_consumer``: loads, never saves (``store.save`` is off; an explicit ``true`` is refused).

Both non-default roles need the Redis tier: it is what the instances share.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from connectors.vllm.config import STORE_KEY, ConnectorConfig
from connectors.vllm.reconstruct import PARAMS_KEY

__all__ = [
    "KV_BOTH",
    "KV_CONSUMER",
    "KV_PRODUCER",
    "ROLES",
    "StoredPrefix",
    "check_role",
    "options_for_role",
    "stored_params",
    "stored_prefix",
]

KV_BOTH, KV_PRODUCER, KV_CONSUMER = "kv_both", "kv_producer", "kv_consumer"
ROLES = (KV_BOTH, KV_PRODUCER, KV_CONSUMER)
STORED_KEY = "stored"


@dataclass(frozen=True)
class StoredPrefix:
    """What a producer stored for a request.

    Attributes:
        tokens: leading prompt tokens whose chunks are in the store (or being saved).
        namespace: hex digest of the store namespace they were stored under.
    """

    tokens: int
    namespace: str


def options_for_role(extra: Mapping[str, Any], role: str) -> dict[str, Any]:
    """``kv_connector_extra_config`` as the role runs it: a consumer never saves.

    Raises:
        ValueError: unknown role, or a consumer told to save.
    """
    if role not in ROLES:
        raise ValueError(f"kv_role must be one of {list(ROLES)}, got {role!r}")
    options = copy.deepcopy(dict(extra))
    if role != KV_CONSUMER:
        return options
    group = options.get(STORE_KEY, {})
    if group is False:
        return options  # check_role says what is missing
    if group is True or group is None:
        group = {}
    if not isinstance(group, Mapping):
        return options  # the config parser names the bad value
    if group.get("save") is True:
        raise ValueError(
            'kv_role "kv_consumer" loads what a producer stored and never saves: remove '
            '"save": true from the "store" group (or run this instance as "kv_both")'
        )
    options[STORE_KEY] = {**group, "save": False}
    return options


def check_role(config: ConnectorConfig, role: str) -> None:
    """Refuse a producer or consumer that shares nothing with the other side."""
    if role == KV_BOTH:
        return
    store = config.store
    needs = "load" if role == KV_CONSUMER else "save"
    if not getattr(store, needs):
        raise ValueError(
            f'kv_role "{role}" needs the store path with store.{needs} on: the producer '
            "stores the prefixes the consumer loads"
        )
    if "redis" not in store.tiers or not store.redis_url:
        raise ValueError(
            f'kv_role "{role}": the producer and consumer share prefixes through the Redis '
            'tier; give the "store" group "tiers": ["cpu", "redis"] and a "redis_url" '
            "(redis:// or redis+cluster://) that both instances reach"
        )


def stored_params(tokens: int, namespace: str) -> dict[str, Any]:
    """The producer's entry of a finished request's ``kv_transfer_params``."""
    return {PARAMS_KEY: {STORED_KEY: {"tokens": int(tokens), "namespace": namespace}}}


def stored_prefix(params: Mapping[str, Any] | None) -> StoredPrefix | None:
    """The producer's entry in a request's ``kv_transfer_params`` (None: none).

    Raises:
        ValueError: the entry is malformed.
    """
    entry = (params or {}).get(PARAMS_KEY)
    if not isinstance(entry, Mapping) or STORED_KEY not in entry:
        return None
    spec = entry[STORED_KEY]
    if (
        not isinstance(spec, Mapping)
        or not isinstance(spec.get("tokens"), int)
        or isinstance(spec.get("tokens"), bool)
        or spec["tokens"] < 0
        or not isinstance(spec.get("namespace"), str)
    ):
        raise ValueError(
            f"kv_transfer_params[{PARAMS_KEY!r}][{STORED_KEY!r}] must be "
            f'{{"tokens": int >= 0, "namespace": str}}, got {spec!r}'
        )
    return StoredPrefix(tokens=spec["tokens"], namespace=spec["namespace"])
