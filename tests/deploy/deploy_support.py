"""Helpers for the static deployment tests: the Helm chart rendered with `helm template`, the compose files parsed.

These tests run under `make deploy-check` (not `make test`): they need the helm binary that `make deploy-tools`
installs into .tools/. Nothing here needs a cluster or a Docker engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "rlhf-pipeline"
EXAMPLES = ROOT / "k8s" / "examples"
COMPOSE_FILES = (
    "docker-compose.yml",
    "compose.gpu.yaml",
    "compose.npu.yaml",
    "compose.npu-hccl.yaml",
    "compose.environment.yaml",
)
SERVICES = ("rollout", "reward", "reference", "trainer")

# The values each example is installed with (docs/deploy.md, "Kubernetes (Helm)"): the example file plus the
# Llama-3.2-1B PPO config.
RENDERS: dict[str, list[str]] = {
    "default": [],
    "gpu": [
        "-f",
        str(EXAMPLES / "values-gpu.yaml"),
        "--set-file",
        f"experiment.configYaml={ROOT / 'configs' / 'llama32-1b-ppo.yaml'}",
    ],
    "npu": [
        "-f",
        str(EXAMPLES / "values-npu.yaml"),
        "--set-file",
        f"experiment.configYaml={ROOT / 'configs' / 'llama32-1b-ppo.yaml'}",
    ],
}


def require_helm() -> str:
    exe = find_helm()
    if exe is None or (not Path(exe).is_file() and shutil.which(exe) is None):
        pytest.fail(
            "helm not found: run `make deploy-tools` (installs it into .tools/) or set HELM=/path/to/helm; "
            "these tests run under `make deploy-check`"
        )
    return exe


def find_helm() -> str | None:
    """$HELM, else the one `make deploy-tools` put under .tools/, else helm on PATH."""
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    local = sorted((ROOT / ".tools").glob("*/helm"))
    if local:
        return str(local[-1])
    return shutil.which("helm")


def helm_template(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [helm, "template", "rlhf", str(CHART), "--namespace", "rlhf", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"helm template {' '.join(args)} failed:\n{proc.stderr}")
    return proc


@dataclass
class Rendered:
    """The manifests of one `helm template` run."""

    docs: list[dict[str, Any]]
    release: str = "rlhf"
    by_kind: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for d in self.docs:
            self.by_kind.setdefault(d["kind"], []).append(d)

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return self.by_kind.get(kind, [])

    def component(self, kind: str, component: str) -> dict[str, Any]:
        """The one object of this kind for a component (for Services: the ClusterIP one, not the headless)."""
        found = [
            d
            for d in self.kind(kind)
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
            and not d["metadata"]["name"].endswith("-headless")
        ]
        assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict[str, Any]]:
        return self.kind("Deployment") + self.kind("StatefulSet") + self.kind("Job")

    def service_workloads(self) -> dict[str, dict[str, Any]]:
        """rollout/reward/reference/trainer -> its Deployment or StatefulSet."""
        out = {}
        for w in self.workloads():
            comp = w["metadata"]["labels"]["app.kubernetes.io/component"]
            if comp in SERVICES:
                out[comp] = w
        return out


def parse_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def render(helm: str, *args: str) -> Rendered:
    return Rendered(parse_docs(helm_template(helm, *args).stdout))


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]
