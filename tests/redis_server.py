"""Shared test helper: a private ``redis-server`` on 127.0.0.1 and a free port.

Reuse from any conftest::

    from tests.redis_server import redis_server_fixture
    redis_server = redis_server_fixture()

A missing ``redis-server`` skips the test, unless ``LMCOMPACT_REQUIRE_REDIS`` is set (CI),
in which case it fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.redis_process import RedisProcess

__all__ = ["RedisProcess", "redis_server_fixture", "require_redis_server"]


def require_redis_server() -> str:
    """Path of ``redis-server``; skip (or fail under LMCOMPACT_REQUIRE_REDIS) when absent."""
    exe = shutil.which("redis-server")
    if exe is None:
        msg = "redis-server not found on PATH (install it: apt-get install -y redis-server)"
        if os.environ.get("LMCOMPACT_REQUIRE_REDIS"):
            pytest.fail(f"{msg}; LMCOMPACT_REQUIRE_REDIS is set", pytrace=False)
        pytest.skip(f"{msg}; set LMCOMPACT_REQUIRE_REDIS=1 to fail instead of skipping")
    return exe


def redis_server_fixture(
    scope: Any = "function", extra_args: list[str] | None = None
) -> Callable[..., Any]:
    """Build a pytest fixture yielding a started :class:`RedisProcess`, stopped by PID after."""

    @pytest.fixture(scope=scope)
    def _fixture() -> Iterator[RedisProcess]:
        server = RedisProcess(executable=require_redis_server(), extra_args=extra_args)
        server.start()
        try:
            yield server
        finally:
            server.stop()

    return _fixture
