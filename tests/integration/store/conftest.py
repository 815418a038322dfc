from __future__ import annotations

from tests.redis_server import redis_server_fixture

redis_server = redis_server_fixture()
"""A fresh redis-server per test (started on a free port, stopped by PID)."""
