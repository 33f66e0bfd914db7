"""docker/Dockerfile (one multi-target image definition) and the files it copies; no Docker engine needed."""

from __future__ import annotations

import http.server
import importlib.util
import os
import re
import subprocess
import sys
import threading
import tomllib

import pytest
import yaml
from deploy_contract import unknown_env
from deploy_support import ROOT, SERVICES
from packaging.requirements import Requirement

DOCKERFILE = ROOT / "docker" / "Dockerfile"


def stages() -> dict[str, str]:
    """Stage name -> its text."""
    text = DOCKERFILE.read_text()
    parts = re.split(r"^FROM ", text, flags=re.M)[1:]
    out = {}
    for part in parts:
        header = part.splitlines()[0]
        m = re.search(r"\bAS\s+(\S+)", header, re.I)
        assert m, f"unnamed stage: FROM {header}"
        out[m.group(1)] = "FROM " + part
    return out


def test_one_target_per_service_on_every_base():
    st = stages()
    for name in SERVICES:
        assert name in st, f"no `{name}` target"
    assert st["rollout"].startswith("FROM app-vllm ")
    for name in ("reward", "reference", "trainer"):
        assert st[name].startswith("FROM app-torch ")
    for accel in ("cpu", "cuda", "ascend"):
        assert f"torch-{accel}" in st and f"vllm-{accel}" in st
    assert st["app-torch"].startswith("FROM torch-${ACCEL} ") and st["app-vllm"].startswith("FROM vllm-${ACCEL} ")
    text = DOCKERFILE.read_text()
    assert "ARG ACCEL=cpu" in text
    for name in SERVICES:
        assert (
            f'CMD ["rlhf", "serve", "{name}", "--config", "/etc/rlhf/config.yaml", "--grpc-port", "50051", '
            f'"--http-port", "8000"]' in st[name]
        )


def test_training_target_is_the_trainer_image_with_peft():
    """The training service needs peft (the lora extra), which the other images leave out."""
    st = stages()
    assert st["training"].startswith("FROM trainer AS training")
    assert "install.sh extra /tmp/rlhf-pyproject.toml lora" in st["training"]
    assert "USER ${APP_UID}:${APP_GID}" in st["training"], "back to the non-root user"
    assert (
        'CMD ["rlhf", "serve", "training", "--config", "/etc/rlhf/config.yaml", "--grpc-port", "50051", '
        '"--http-port", "8000"]' in st["training"]
    )


def test_environment_target_is_the_reward_image_with_its_own_command():
    """The environment service (torch-free) shares app-torch's layers: only its CMD differs from reward's."""
    st = stages()
    assert st["environment"].startswith("FROM app-torch AS environment")
    body = [ln for ln in st["environment"].splitlines()[1:] if ln.strip() and not ln.startswith("#")]
    assert body == [
        'CMD ["rlhf", "serve", "environment", "--config", "/etc/rlhf/config.yaml", "--grpc-port", "50051", '
        '"--http-port", "8000"]'
    ]


def test_runtime_stages_are_non_root_with_a_readiness_healthcheck():
    st = stages()
    for name in ("app-torch", "app-vllm"):
        assert re.search(r"^USER \$\{APP_UID\}:\$\{APP_GID\}$", st[name], re.M), name
        assert "HEALTHCHECK" in st[name] and '"/opt/rlhf/healthcheck.py"' in st[name]
        assert 'ENTRYPOINT ["/opt/rlhf/entrypoint.sh"]' in st[name]
    assert "ARG APP_UID=10001" in st["app-torch"]
    assert "/readyz" in (ROOT / "docker" / "healthcheck.py").read_text()


def pinned_torch() -> str:
    """The torch version `make setup` pins (the Makefile's TORCH_PIN); pyproject.toml has the supported range."""
    (version,) = re.findall(r"^TORCH_PIN := torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    return version


def test_versions_are_pinned_as_the_project_pins_them():
    text = DOCKERFILE.read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = f"torch=={pinned_torch()}"
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}" in text
    (vllm_pin,) = pyproject["project"]["optional-dependencies"]["vllm"]
    assert f"ARG VLLM_CPU_VERSION={vllm_pin.split('==')[1]}" in text
    # the npu extra is torch-npu for the CPU venv's torch (local development); the Ascend images use their own set
    (npu_pin,) = pyproject["project"]["optional-dependencies"]["npu"]
    assert npu_pin == f"torch-npu=={torch_pin.split('==')[1]}"
    assert "https://download.pytorch.org/whl/cpu" in stages()["torch-cpu"]
    assert "pip uninstall -y torchvision torchaudio torchcodec" in stages()["vllm-cpu"]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    for line in re.findall(r"^ARG \w+_IMAGE(?:_\w+)?=(\S+)$", text, re.M):
        line = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], line)  # tags built from the version sets
        assert re.search(r":[\w.-]+$", line) and not line.endswith(":latest"), f"unpinned base image {line}"


def test_dockerignore_keeps_the_context_small():
    lines = (ROOT / ".dockerignore").read_text().split()
    assert lines[lines.index("**")] == "**", "ignore everything, then allow what the image needs"
    for needed in ("!pyproject.toml", "!README.md", "!rlhf/", "!services/", "!configs/", "!docker/"):
        assert needed in lines


@pytest.mark.parametrize(("status", "expected"), [(200, 0), (503, 1)])
def test_healthcheck_script(monkeypatch, status, expected):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's naming
            self.send_response(status if self.path == "/readyz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "docker" / "healthcheck.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setenv("RLHF_HTTP_PORT", str(server.server_address[1]))
        monkeypatch.delenv("RLHF_TLS_CERT", raising=False)
        assert module.main() == expected
    finally:
        server.shutdown()
        server.server_close()


def test_image_env_vars_are_known_to_the_code():
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    names = {m for line in re.findall(r"^ENV (.+)$", text, re.M) for m in re.findall(r"(\w+)=", line)}
    assert "RLHF_CONFIG" in names and "VLLM_CPU_KVCACHE_SPACE" in names
    assert not unknown_env(names), f"the image sets variables nothing reads: {unknown_env(names)}"


def test_accelerator_images_spawn_vllm_workers_and_ascend_installs_use_pypi():
    st = stages()
    for name in ("vllm-cuda", "vllm-ascend"):
        assert re.search(r"^ENV VLLM_WORKER_MULTIPROC_METHOD=spawn$", st[name], re.M), name
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in st["vllm-cpu"]  # in-process engine core on CPU: nothing forks
    for name in ("torch-ascend", "vllm-ascend"):
        # the base's pip.conf (a mirror as the global index) must not reach the project's installs
        assert re.search(r"^ENV PIP_CONFIG_FILE=/dev/null PIP_INDEX_URL=\$\{ASCEND_PIP_INDEX_URL\}$", st[name], re.M)
        assert "ARG ASCEND_PIP_INDEX_URL=https://pypi.org/simple" in st[name], name


def _readme_version_sets() -> dict[str, str]:
    """docs/deploy.md "Version sets" table (once the README's): accelerator -> its row's text."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text[text.index("#### Version sets") :]
    rows = re.findall(r"^\| `(cpu|cuda|ascend)` \|(.+)$", section, re.M)
    return {accel: row for accel, row in rows}


def test_version_sets_are_one_per_accelerator_and_the_readme_states_them():
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))
    rows = _readme_version_sets()
    assert set(rows) == {"cpu", "cuda", "ascend"}
    expected = {
        "cpu": ["TORCH_VERSION", "VLLM_CPU_VERSION"],
        "cuda": ["CUDA_VLLM_VERSION", "CUDA_TORCH_VERSION"],
        "ascend": [
            "ASCEND_VLLM_ASCEND_VERSION",
            "ASCEND_VLLM_VERSION",
            "ASCEND_CANN_VERSION",
            "ASCEND_TORCH_VERSION",
            "ASCEND_TORCH_NPU_VERSION",
            "ASCEND_TRANSFORMERS_VERSION",
        ],
    }
    for accel, names in expected.items():
        for name in names:
            version = rf"(?<![\w.]){re.escape(args[name])}(?![\w.]*\d)"  # 2.10.0 is not 2.10.0.post4
            assert re.search(version, rows[accel]), f"docs/deploy.md's {accel} row lacks {name}={args[name]}"
    # the base images are named by the sets, not by separate tags that could drift from them
    assert args["CUDA_VLLM_IMAGE"].endswith(":v${CUDA_VLLM_VERSION}")
    assert args["ASCEND_VLLM_IMAGE_910B"].endswith(":v${ASCEND_VLLM_ASCEND_VERSION}")
    assert args["ASCEND_VLLM_IMAGE_A3"].endswith(":v${ASCEND_VLLM_ASCEND_VERSION}-a3")
    assert "${ASCEND_CANN_VERSION}" in args["ASCEND_CANN_IMAGE"]
    st = stages()
    assert '"torch==${CUDA_TORCH_VERSION}"' in st["torch-cuda"]
    assert '"torch-npu==${ASCEND_TORCH_NPU_VERSION}"' in st["torch-ascend"]
    for name, pins in (("vllm-cuda", ["vllm==", "torch=="]), ("vllm-ascend", ["vllm-ascend==", "transformers=="])):
        assert "check_versions.py" in st[name], f"{name} does not verify its base against the version set"
        for pin in pins:
            assert f'"{pin}' in st[name], (name, pin)


def test_project_transformers_range_admits_every_base():
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if d.startswith("transformers")]
    assert args["ASCEND_TRANSFORMERS_VERSION"] in req.specifier, (str(req), "the vllm-ascend image's")
    assert "5.20.2" in req.specifier, "vLLM 0.33.0 allows transformers <5.21; its image may carry 5.20.x"


def test_project_torch_range_admits_every_base_and_the_images_leave_the_plots_out():
    """torch is a range in the package metadata; the tested versions are the set-up's pin and the bases'. The images
    install the core dependencies only (docker/install.sh), so matplotlib and TensorBoard stay in the plots extra."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [Requirement(d) for d in project["dependencies"]]
    (torch,) = [r for r in deps if r.name == "torch"]
    for version in (pinned_torch(), args["TORCH_VERSION"], args["CUDA_TORCH_VERSION"], args["ASCEND_TORCH_VERSION"]):
        assert version in torch.specifier, (str(torch), version)
    assert not {"matplotlib", "tensorboard"} & {r.name for r in deps}
    assert {Requirement(d).name for d in project["optional-dependencies"]["plots"]} == {"matplotlib", "tensorboard"}


def test_the_images_read_the_parquet_data_the_shipped_configs_name():
    """The trainer reads data.path; the GPU/NPU configs compose and the Helm examples run name a parquet file, and
    the images install the core dependencies only, so pyarrow is one of them."""
    parquet = [
        c.name
        for c in (ROOT / "configs").glob("*.yaml")
        if str(yaml.safe_load(c.read_text()).get("data", {}).get("path", "")).endswith(".parquet")
    ]
    assert parquet, "no shipped config reads parquet: this test has nothing to check"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "pyarrow" in {Requirement(d).name for d in deps}, parquet


def _expand(args: dict[str, str], **overrides: str) -> dict[str, str]:
    """The Dockerfile's global ARGs as a build with ``--build-arg`` overrides would see them."""
    out: dict[str, str] = {}
    for name, value in args.items():
        value = overrides.get(name, value)
        out[name] = re.sub(r"\$\{(\w+)\}", lambda m: out[m.group(1)], value)
    return out


@pytest.mark.parametrize(
    ("soc", "cann", "vllm_ascend", "soc_version"),
    [
        (
            "910b",
            "quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.11",
            "quay.io/ascend/vllm-ascend:v0.23.0",
            "ascend910b1",
        ),
        (
            "a3",
            "quay.io/ascend/cann:9.1.0-a3-ubuntu22.04-py3.11",
            "quay.io/ascend/vllm-ascend:v0.23.0-a3",
            "ascend910_9391",
        ),
    ],
)
def test_ascend_soc_picks_both_base_images(soc, cann, vllm_ascend, soc_version):
    """Issue 27.6: ASCEND_SOC=910b|a3 selects the CANN base (its tag names the SoC) and the vllm-ascend base (A3: the
    -a3 tag suffix), and the vllm-ascend stage refuses a base built for the other SoC (SOC_VERSION, as vllm-ascend's
    Dockerfile and Dockerfile.a3 set it)."""
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    assert args["ASCEND_SOC"] == "910b", "Atlas A2 stays the default"
    built = _expand(args, ASCEND_SOC=soc)
    assert built["ASCEND_CANN_IMAGE"] == cann
    # the CANN base keeps the Python of the project's other images (python:3.11-slim)
    assert built["ASCEND_CANN_IMAGE"].endswith("-py" + re.search(r"python:(\d+\.\d+)", args["PYTHON_IMAGE"])[1])
    st = stages()
    assert st["torch-ascend"].startswith("FROM ${ASCEND_CANN_IMAGE} ")
    assert st["vllm-ascend"].startswith("FROM vllm-ascend-base-${ASCEND_SOC} ")
    base = st[f"vllm-ascend-base-{soc}"]
    (image_arg,) = re.findall(r"^FROM \$\{(\w+)\} AS ", base, re.M)
    assert built[image_arg] == vllm_ascend
    assert set(st) >= {"vllm-ascend-base-910b", "vllm-ascend-base-a3"}
    assert re.search(r'check_versions\.py --ascend-soc "\$\{ASCEND_SOC\}"', st["vllm-ascend"])
    assert re.search(r"^ARG ASCEND_SOC$", st["vllm-ascend"], re.M), "the stage must import the global ARG"
    # what that check does inside a base of each generation
    check = [sys.executable, str(ROOT / "docker" / "check_versions.py"), "--ascend-soc", soc]
    ok = subprocess.run(check, env={**os.environ, "SOC_VERSION": soc_version}, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert f"ASCEND_SOC={soc}, SOC_VERSION={soc_version}" in ok.stdout
    other = {"ascend910b1": "ascend910_9391", "ascend910_9391": "ascend910b1"}[soc_version]
    bad = subprocess.run(check, env={**os.environ, "SOC_VERSION": other}, capture_output=True, text=True)
    assert bad.returncode != 0 and f"built for SOC_VERSION={other}" in bad.stderr


@pytest.mark.parametrize(
    ("soc", "env", "message"),
    [
        ("a2", {"SOC_VERSION": "ascend910b1"}, "must be one of 910b, a3"),
        ("910b", {}, "sets no SOC_VERSION"),
    ],
)
def test_check_versions_refuses_an_unknown_soc_or_an_unmarked_base(soc, env, message):
    base_env = {k: v for k, v in os.environ.items() if k != "SOC_VERSION"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "check_versions.py"), "--ascend-soc", soc],
        env={**base_env, **env},
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
