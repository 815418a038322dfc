"""vLLM 0.26 hands the connector only the manager's block pool: the manager is found by
recording managers as they are created (no stack walk)."""

from __future__ import annotations

from typing import Any

import pytest

from connectors.vllm.patches import kv_cache_manager


def manager_class() -> Any:
    class Manager:  # stands in for vLLM's KVCacheManager: same constructor contract
        def __init__(self, block_pool: Any) -> None:
            self.block_pool = block_pool

    return Manager


def test_a_manager_created_after_tracking_is_found_by_its_pool() -> None:
    cls = manager_class()
    assert kv_cache_manager.track_kv_cache_managers(cls)
    pool, other_pool = object(), object()
    manager = cls(pool)
    cls(other_pool)
    assert kv_cache_manager.kv_cache_manager_owning(pool) is manager
    assert kv_cache_manager.kv_cache_manager_owning(object()) is None  # identity, not equality


def test_managers_created_before_tracking_are_not_found() -> None:
    cls = manager_class()
    pool = object()
    cls(pool)
    assert kv_cache_manager.kv_cache_manager_owning(pool) is None
    kv_cache_manager.track_kv_cache_managers(cls)
    assert kv_cache_manager.kv_cache_manager_owning(pool) is None


def test_tracking_is_idempotent() -> None:
    cls = manager_class()
    kv_cache_manager.track_kv_cache_managers(cls)
    init = cls.__init__
    kv_cache_manager.track_kv_cache_managers(cls)
    assert cls.__init__ is init  # not wrapped twice


def test_vllm_managers_are_tracked() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert kv_cache_manager.track_kv_cache_managers()
    assert getattr(KVCacheManager, "_lmcompact_tracked", False)
