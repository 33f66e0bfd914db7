"""End-to-end fixtures: whole training rings of real processes on loopback (see _ring.py)."""

from __future__ import annotations

import pytest

from tests.e2e._ring import Rings, SharedScorers


@pytest.fixture(scope="session")
def scorers(tiny_models, tmp_path_factory):
    """A reward and a reference service shared by every ring of the session (both stateless)."""
    pool = SharedScorers(tmp_path_factory.mktemp("e2e-scorers"))
    yield pool
    pool.stop()


@pytest.fixture
def rings(scorers, tmp_path):
    """``rings(run_id, **options)``: a Ring of this test (not started) on a redis-server of its own and the session's
    reward and reference; every ring, redis-server and service it made or was given (``rings.own``) is stopped after
    the test (:class:`Rings`)."""
    rings = Rings(tmp_path, scorers)
    yield rings
    rings.close()


@pytest.fixture(scope="module")
def module_rings(scorers, tmp_path_factory, request):
    """The ``rings`` factory for a module's rings, started once and read by its tests; stopped after the module."""
    rings = Rings(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), scorers)
    yield rings
    rings.close()
