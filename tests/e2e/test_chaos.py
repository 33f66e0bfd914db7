"""One short round of tests/e2e/chaos.py inside `make test`: every fault once, then the targets (`make chaos` runs
the long version)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.chaos import FAULTS, MAX_STALENESS, Chaos

pytestmark = pytest.mark.slow


def test_chaos_round_loses_nothing_and_recovers_from_every_fault(tmp_path, tiny_models):
    chaos = Chaos(tmp_path, rounds=1)
    try:
        result = chaos.run()
    finally:
        chaos.stop()
    print(json.dumps(result))  # the figures, in the -rA / -s output
    assert [f["fault"] for f in result["faults"]] == FAULTS
    assert result["recovered"] == result["faults_injected"] == len(FAULTS)
    assert result["jobs_lost"] == 0 and result["jobs_trained_twice"] == 0
    assert result["jobs_trained"] == result["steps"] * 4
    # The poison records are dead letters, and being foreign they freed no admission slot.
    assert result["dead_letters"] >= result["poison_injected"] == 3
    assert result["released"] == result["jobs_dead_lettered"] == 0
    assert result["nonfinite_steps_skipped"] == 0
    storm = next(f for f in result["faults"] if f["fault"] == "admin_storm")
    assert storm["ok"] == storm["calls"]
    assert set(result["served_versions"]) == {result["final_policy_version"]}
    assert result["max_staleness"] <= MAX_STALENESS  # in training steps, across the trainer's restart too
