"""What the test folders share: records (``experiences``), the private redis-server (``redis``) and, importing
torch, responses sampled from a trainer's actor (``sampling``) and a rollout replica to push weights to, in the test's
process or a child process (``replica``; bench.device_check's push phase uses it too).

Imported as ``tests.support`` (the repository root is on ``sys.path``: ``pythonpath`` in pyproject.toml's pytest
settings, ``PYTHONPATH`` for the workers the tests start). The fixtures built on it (``redis_server``,
``tiny_models``) are in tests/conftest.py.
"""

from tests.support.experiences import make_experience, make_experiences, make_prompt_job, make_sample
from tests.support.redis import RedisServer

__all__ = ["RedisServer", "make_experience", "make_experiences", "make_prompt_job", "make_sample"]
