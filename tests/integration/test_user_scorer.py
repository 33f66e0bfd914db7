"""A user's ``module:function`` scorer next to the config imports under ``rlhf serve reward`` run from that folder,
through the installed ``rlhf`` console script (which, unlike ``python -m``, does not put the working directory on
``sys.path``): the rule is "the working directory", the same under ``rlhf up`` and ``rlhf serve``."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.integration._procs import ServiceProc, write_config

RLHF_SCRIPT = Path(sys.executable).parent / "rlhf"


class ConsoleScriptProc(ServiceProc):
    @property
    def argv(self) -> list[str]:
        return [str(RLHF_SCRIPT), *super().argv[3:]]  # drop "python -m services.cli"


@pytest.mark.skipif(not RLHF_SCRIPT.exists(), reason="the rlhf console script is not installed in this environment")
def test_serve_reward_imports_a_scorer_module_from_the_working_directory(tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    (work / "my_scorer_mod_16.py").write_text(
        "def score(prompt, response, label=None):\n    return 0.25 + len(response)\n"
    )
    cfg = write_config(work / "exp.yaml", {"reward": {"scorers": [{"type": "rule", "name": "my_scorer_mod_16:score"}]}})
    with ConsoleScriptProc("reward", cfg.name, tmp_path / "logs", cwd=work) as svc:
        r = httpx.post(svc.http_url + "/v1/score", json={"items": [{"prompt": "p", "response": "abc"}]}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["score"] == pytest.approx(3.25), r.text
