"""The scheduler half reads a request's ``save`` flag and ``token_scores`` (self_info).

The real-engine counterpart: ``tests/integration/vllm/test_surprisal_store.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcompact.store import ChunkKeyer, StoreConfig, StoreNamespace, TieredStore
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.reconstruct import PARAMS_KEY
from lmcompact.vllm.scheduler_side import SchedulerHalf

CHUNK = 64


def _half(policy: str) -> SchedulerHalf:
    namespace = StoreNamespace(
        model_id="tiny", kv_dtype="float32", kv_layout="rows", policy_name=policy
    )
    facts = shim.EngineFacts(
        model_id="tiny", block_size=32, num_layers=2, num_kv_heads=1, head_dim=8,
        dtype=torch.float32, prefix_caching=False, device_type="cpu", tp_size=1,
    )  # fmt: skip
    config = ConnectorConfig.from_extra({"policy": policy, "chunk_size": CHUNK, "budget": 0.5})
    store = TieredStore(namespace, StoreConfig(cpu_capacity_bytes=1 << 24))
    return SchedulerHalf(config, facts, store, ChunkKeyer(namespace, CHUNK))


def _request(req_id: str, prompt: list[int], entry: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=prompt, kv_transfer_params={PARAMS_KEY: entry}
    )


def test_scoring_and_storing_requests_are_read() -> None:
    half = _half("self_info")
    prompt = list(range(2 * CHUNK + 3))
    probe = _request("probe", prompt, {"save": False})
    assert half.num_new_matched_tokens(probe, 0) == 0
    assert half.states["probe"].no_save and half.states["probe"].token_scores is None
    scores = [float(i % 7) for i in range(len(prompt))]
    store = _request("store", prompt, {"token_scores": scores})
    half.num_new_matched_tokens(store, 0)
    assert not half.states["store"].no_save
    assert half.states["store"].token_scores == scores


def test_bad_or_unusable_scores_are_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    prompt = list(range(CHUNK + 1))
    half = _half("self_info")
    with caplog.at_level(logging.ERROR, logger="lmcompact.vllm.scheduler_side"):
        half.num_new_matched_tokens(_request("short", prompt, {"token_scores": [1.0]}), 0)
    assert half.states["short"].token_scores is None
    assert "finite numbers" in caplog.text
    caplog.clear()
    plain = _half("snapkv")  # does not read context scores
    with caplog.at_level(logging.ERROR, logger="lmcompact.vllm.scheduler_side"):
        plain.num_new_matched_tokens(_request("r", prompt, {"token_scores": [0.0] * 65}), 0)
    assert plain.states["r"].token_scores is None
    assert "does not read context scores" in caplog.text
