"""End-to-end fixtures: whole training rings of real processes on loopback (see _ring.py)."""

from __future__ import annotations

import pytest
from _ring import SharedScorers


@pytest.fixture(scope="session")
def scorers(tiny_models, tmp_path_factory):
    """A reward and a reference service shared by every ring of the session (both stateless)."""
    pool = SharedScorers(tmp_path_factory.mktemp("e2e-scorers"))
    yield pool
    pool.stop()
