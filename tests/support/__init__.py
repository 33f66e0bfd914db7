"""What the test folders share: the private redis-server (``redis``).

Imported as ``tests.support`` (the repository root is on ``sys.path``: ``pythonpath`` in pyproject.toml's pytest
settings, ``PYTHONPATH`` for the workers the tests start). The fixtures built on it (``redis_server``,
``tiny_models``) are in tests/conftest.py.
"""

from tests.support.redis import RedisServer

__all__ = ["RedisServer"]
