"""The served weights version's one owner and its one rule (rlhf.transport.weights.version)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf.serving.errors import status_for
from rlhf.transport.weights.errors import CorruptUpdate, StaleVersion
from rlhf.transport.weights.version import ServedVersion, check_newer


def test_newer_is_version_above_the_served_one_and_a_parent_below_it():
    assert check_newer(1, 0, 0) is True  # the next version, from the served one: a continuation
    assert check_newer(5, 2, 0) is False  # a jump (missed pushes, or a restored trainer): accepted, not continuous
    with pytest.raises(StaleVersion):
        check_newer(3, 2, 3)  # the same version again
    with pytest.raises(StaleVersion):
        check_newer(2, 1, 3)  # backwards
    for parent in (3, 4, -1):  # a parent must be older than the update, and a version
        with pytest.raises(CorruptUpdate):
            check_newer(3, parent, 0)
    assert status_for(StaleVersion("x"))[1] == 409 and status_for(CorruptUpdate("x"))[1] == 400


def test_the_owner_only_moves_forward_and_counts_jumps():
    served = ServedVersion()
    assert (served.version, served.checksum, served.loaded_at_unix_ms) == (0, "initial", 0)
    served.advance(1, 0, "c1")
    served.advance(4, 2, "c4")  # missed 2 and 3
    assert (served.version, served.parent_version, served.checksum, served.jumps) == (4, 2, "c4", 1)
    assert served.loaded_at_unix_ms > 0
    with pytest.raises(StaleVersion):
        served.advance(4, 3, "again")
    assert served.checksum == "c4"  # a refused advance changes nothing


def test_importing_the_version_owner_loads_no_torch():
    # the rollout engine module imports it; torch must load after the service sets OMP_NUM_THREADS
    code = "import sys, rlhf.transport.weights.version, rlhf.transport.weights; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
