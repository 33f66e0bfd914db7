"""The private redis-server of the tests: the ``redis_server`` fixture's (tests/conftest.py) and the e2e rings'."""

from __future__ import annotations

import shutil

from rlhf.procs import LocalRedis


class RedisServer(LocalRedis):
    """A redis-server owned by the test: own port, own directory, AOF on (everysec, as compose and Helm run it), so
    a restart on the same directory and port keeps the data. Without redis-server on PATH the test fails (not an
    error inside the code under test)."""

    def start(self, timeout: float = 15.0) -> RedisServer:
        if shutil.which("redis-server") is None:
            import pytest  # noqa: PLC0415 - bench.device_check imports tests.support on hosts without pytest

            pytest.fail("redis-server is not on PATH (apt-get install -y redis-server)")
        super().start(timeout)
        return self
