from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server per test: tests that stop or restart it stay independent."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
