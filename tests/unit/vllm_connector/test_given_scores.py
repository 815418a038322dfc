"""The scheduler side reads a request's ``save`` flag and ``token_scores`` (self_info).

The real-engine counterpart: ``tests/integration/vllm/test_surprisal_store.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from connectors.vllm.reconstruct import PARAMS_KEY
from connectors.vllm.scheduler import Scheduler
from tests.unit.vllm_connector import fakes

CHUNK = 64


def _scheduler(policy: str) -> Scheduler:
    return fakes.scheduler({"policy": policy, "budget": 0.5, "store": {"chunk_size": CHUNK}})


def _request(req_id: str, prompt: list[int], entry: dict[str, Any]) -> SimpleNamespace:
    return fakes.request(req_id, prompt, {PARAMS_KEY: entry})


def test_scoring_and_storing_requests_are_read() -> None:
    scheduler = _scheduler("self_info")
    prompt = list(range(2 * CHUNK + 3))
    probe = _request("probe", prompt, {"save": False})
    assert scheduler.num_new_matched_tokens(probe, 0) == 0
    assert scheduler.states["probe"].no_save and scheduler.states["probe"].token_scores is None
    scores = [float(i % 7) for i in range(len(prompt))]
    store = _request("store", prompt, {"token_scores": scores})
    scheduler.num_new_matched_tokens(store, 0)
    assert not scheduler.states["store"].no_save
    assert scheduler.states["store"].token_scores == scores


def test_bad_or_unusable_scores_are_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    prompt = list(range(CHUNK + 1))
    scheduler = _scheduler("self_info")
    with caplog.at_level(logging.ERROR, logger="connectors.vllm.scheduler"):
        scheduler.num_new_matched_tokens(_request("short", prompt, {"token_scores": [1.0]}), 0)
    assert scheduler.states["short"].token_scores is None
    assert "finite numbers" in caplog.text
    caplog.clear()
    plain = _scheduler("snapkv")  # does not read context scores
    with caplog.at_level(logging.ERROR, logger="connectors.vllm.scheduler"):
        plain.num_new_matched_tokens(_request("r", prompt, {"token_scores": [0.0] * 65}), 0)
    assert plain.states["r"].token_scores is None
    assert "does not read context scores" in caplog.text
