"""``LMCompactConnector`` that refuses to send KV through its step metadata (tests only).

Loaded by module path inside vLLM's engine process (multiprocess mode), where a test cannot
reach the scheduler: a tensor in any metadata it builds raises, which fails the engine and
so the test. Real counterpart: the connector itself, unchanged.
"""

from __future__ import annotations

from typing import Any

from connectors.vllm.connector import LMCompactConnector, LMCompactMetadata
from tests.integration.vllm.tensor_walk import tensors_in


class CheckedConnector(LMCompactConnector):
    def build_connector_meta(self, scheduler_output: Any) -> LMCompactMetadata:
        meta = super().build_connector_meta(scheduler_output)
        found = list(tensors_in(meta))
        if found:
            raise AssertionError(f"connector metadata carries tensors: {found}")
        return meta
