"""The Services examples of docs/services.md (Reward and Reference subsections) run as written against live services
(they were the README's until it became an overview).

Every ``rlhf serve`` line starts that service (on free ports: ``localhost:<page port>`` is rewritten to the real
one); every ``curl`` / ``rlhf score|logprobs`` command and every Python block then runs, must succeed and print JSON
(or protobuf text); a ``# -> ...`` line after a command is the documented answer: an error when it shows one, the
same numbers when it is complete JSON.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlhf.config import load_config
from tests.integration._procs import REPO, ServiceProc

SUBSECTIONS = ("Reward", "Reference")
PAGE = REPO / "docs" / "services.md"  # where the examples are


@dataclass
class Command:
    kind: str  # "bash" or "python"
    text: str
    expected: str | None = None


@dataclass
class Example:
    serves: list[tuple[str, str, int, int]] = field(default_factory=list)  # (service, config, http, grpc)
    commands: list[Command] = field(default_factory=list)


def services_section(readme: str) -> str:
    m = re.search(r"^## Services\n(.*?)(?=^## )", readme, re.S | re.M)
    assert m, "docs/services.md has no '## Services' section"
    return m.group(1)


def parse(readme: str) -> Example:
    section = services_section(readme)
    ex = Example()
    for sub in SUBSECTIONS:
        m = re.search(rf"^### {sub}\n(.*?)(?=^### |\Z)", section, re.S | re.M)
        assert m, f"docs/services.md Services has no '### {sub}' subsection"
        for lang, block in re.findall(r"```(bash|python)\n(.*?)```", m.group(1), re.S):
            if lang == "python":
                ex.commands.append(Command("python", block))
                continue
            lines = block.replace("\\\n", " ").splitlines()
            for line in lines:
                line = line.strip()
                if not line:
                    continue
                if line.startswith("# ->"):
                    assert ex.commands, "an expected answer without a command"
                    ex.commands[-1].expected = line[4:].strip()
                elif line.startswith("rlhf serve "):
                    s = re.fullmatch(r"rlhf serve (\w+) --config (\S+) --http-port (\d+) --grpc-port (\d+) &", line)
                    assert s, f"unexpected serve line in docs/services.md: {line}"
                    ex.serves.append((s[1], s[2], int(s[3]), int(s[4])))
                elif line.startswith(("curl ", "rlhf ")):
                    ex.commands.append(Command("bash", line))
                elif not line.startswith("#"):
                    pytest.fail(f"docs/services.md Services: a command the test does not know how to run: {line}")
    return ex


def close(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= 1e-5
    return a == b


def test_readme_parses():
    ex = parse(PAGE.read_text())
    assert {s[0] for s in ex.serves} == {"reward", "reference"}
    assert sum(c.kind == "bash" and c.text.startswith("curl ") for c in ex.commands) >= 4
    assert any(c.kind == "python" for c in ex.commands)


def test_readme_service_examples_work(shared_services, tmp_path):
    ex = parse(PAGE.read_text())
    own, ports = [], {}
    try:
        for service, config, http, grpc_port in ex.serves:
            assert (REPO / config).is_file(), f"docs/services.md names a config that does not exist: {config}"
            if (service, config) in shared_services.shared:
                p = shared_services.get(service, config)
            else:  # not shared with other tests: a private process
                p = ServiceProc(service, REPO / config, tmp_path).start()
                own.append(p)
            ports[http], ports[grpc_port] = p.http_port, p.grpc_port

        def localize(text: str) -> str:
            return re.sub(r"localhost:(\d+)", lambda m: f"127.0.0.1:{ports.get(int(m[1]), m[1])}", text)

        for cmd in ex.commands:
            if cmd.kind == "python":
                run = subprocess.run(
                    [sys.executable, "-c", localize(cmd.text)], cwd=REPO, capture_output=True, text=True, timeout=60
                )
                assert run.returncode == 0, f"README python block failed:\n{cmd.text}\n{run.stderr}"
                assert "results" in run.stdout
                continue
            line = localize(cmd.text)
            if line.startswith("rlhf "):
                line = f"{sys.executable} -m services.cli " + line[len("rlhf ") :]
            run = subprocess.run(["bash", "-c", line], cwd=REPO, capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, f"README command failed: {cmd.text}\n{run.stdout}\n{run.stderr}"
            out = json.loads(run.stdout)
            if cmd.expected is None:
                assert "error" not in out, f"{cmd.text}\n-> {out}"
                continue
            assert cmd.expected.startswith('{"error"') == ("error" in out), (
                f"{cmd.text}\n-> {out}\nREADME: {cmd.expected}"
            )
            try:
                want = json.loads(cmd.expected)
            except ValueError:  # an abbreviated answer ("...")
                continue
            assert close(out, want), f"{cmd.text}\nanswered {out}\nREADME   {want}"
    finally:
        for p in own:
            p.stop()


def test_every_readme_config_is_valid():
    for _, config, _, _ in parse(PAGE.read_text()).serves:
        load_config(Path(REPO / config))
