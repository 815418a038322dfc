"""Connector log records reach vLLM's handlers whatever the root logger holds.

The real counterpart: ``tests/integration/vllm/test_connector_logs.py`` (engines in
subprocesses, in-process and multiprocess, their output read back).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from connectors.vllm.patches.engine import EngineLogForwarder, share_engine_logging

PACKAGE = "lmc_logging_probe"


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def engine_handler(monkeypatch: pytest.MonkeyPatch) -> Iterator[Kept]:
    kept = Kept()
    engine = logging.getLogger("vllm")
    monkeypatch.setattr(engine, "handlers", [kept])
    monkeypatch.setattr(engine, "level", logging.INFO)
    ours = logging.getLogger(PACKAGE)
    yield kept
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)


def test_info_reaches_vllm_handlers_without_root_handlers(
    engine_handler: Kept, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    share_engine_logging((PACKAGE,))
    share_engine_logging((PACKAGE,))  # idempotent: one forwarder
    logging.getLogger(f"{PACKAGE}.worker").info("compacted r1 in place")
    assert engine_handler.messages == ["compacted r1 in place"]
    assert sum(isinstance(h, EngineLogForwarder) for h in logging.getLogger(PACKAGE).handlers) == 1


def test_info_is_not_dropped_when_a_library_gave_the_root_a_handler(
    engine_handler: Kept, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root handler at the root's default WARNING level used to swallow our INFO lines
    (the H200 `vllm serve` log showed none of the engine core's); now they are printed once,
    by the root's handler."""
    root_handler = Kept()
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [root_handler])
    monkeypatch.setattr(root, "level", logging.WARNING)
    share_engine_logging((PACKAGE,))
    logging.getLogger(f"{PACKAGE}.scheduler").info("loading r2 from the store")
    assert root_handler.messages == ["loading r2 from the store"]
    assert engine_handler.messages == []


def test_own_handlers_and_switched_off_engine_logging_are_left_alone(
    engine_handler: Kept, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = logging.getLogger(PACKAGE)
    own = Kept()
    ours.addHandler(own)
    share_engine_logging((PACKAGE,))
    assert ours.handlers == [own] and ours.level == logging.NOTSET
    ours.handlers.clear()
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])
    share_engine_logging((PACKAGE,))
    assert ours.handlers == [] and ours.level == logging.NOTSET
