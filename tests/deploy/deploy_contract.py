"""What the deployment files must agree on with the code: the `rlhf` command line and the environment variables."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterable

import pytest

# Variables the deployment files may set that are not the project's RLHF_* settings, and why.
NON_RLHF_ENV = {
    "HF_HUB_OFFLINE": "transformers / huggingface_hub: never download at run time (models are local or tiny:*)",
    "OMP_NUM_THREADS": "torch / vLLM threads per process: the container's cores, not the host's (oversubscription)",
    "VLLM_CPU_KVCACHE_SPACE": "vLLM's CPU backend: KV-cache GiB; without it start-up refuses on a small machine",
    "REDIS_PASSWORD": "chart only: expanded into RLHF_REDIS_URL ($(REDIS_PASSWORD)) and redis-server --requirepass",
    "REDISCLI_AUTH": "the redis container only: lets redis-cli (health checks) authenticate",
    "PYTHONUNBUFFERED": "image: log lines reach `docker logs` / `kubectl logs` at once",
    "PYTHONDONTWRITEBYTECODE": "image: no .pyc files written at run time",
    "PIP_NO_CACHE_DIR": "image build: keep pip's cache out of the layers",
    "PIP_DISABLE_PIP_VERSION_CHECK": "image build: no network call for pip's version check",
    "PIP_BREAK_SYSTEM_PACKAGES": "image build: install into the system Python of the Ubuntu-based vLLM/CANN bases",
    "HOME": "image: the non-root user's home (torch and vLLM caches)",
    "NCCL_SOCKET_IFNAME": "GPU trainer (values-gpu.yaml): NCCL's bootstrap/socket interface between trainer pods",
    "NCCL_DEBUG": "GPU trainer (values-gpu.yaml): NCCL's log level",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "GPU trainer: a failed or timed-out NCCL collective fails the process group",
    "HCCL_SOCKET_IFNAME": "NPU trainer (values-npu.yaml): HCCL's host socket interface between trainer pods",
    "HCCL_CONNECT_TIMEOUT": "NPU trainer: seconds to establish HCCL links between ranks",
    "HCCL_EXEC_TIMEOUT": "NPU trainer: seconds before HCCL fails a hung collective",
    "HCCL_HOST_SOCKET_PORT_RANGE": "NPU trainer and rollout on the host network (compose.npu-hccl.yaml, "
    "weightSync.hostNetwork): auto, so HCCL's host sockets in the two processes do not take the same default ports",
    "PIP_CONFIG_FILE": "Ascend image build: /dev/null, so the base's pip.conf (a mirror as global index) is ignored",
    "PIP_INDEX_URL": "Ascend image build: PyPI (or ASCEND_PIP_INDEX_URL) for the project's requirements",
    "VLLM_WORKER_MULTIPROC_METHOD": "vLLM: spawn its workers (the service already runs gRPC/HTTP threads)",
    "VLLM_ASCEND_ENABLE_NZ": "vllm-ascend: 0 keeps weights in the ND layout in-place reloads write",
}


def known_env_vars() -> tuple[str, ...]:
    try:
        serving = importlib.import_module("rlhf.serving")
    except ImportError as err:  # the module is written concurrently; this assertion stays and passes once it lands
        pytest.fail(f"rlhf.serving is not importable ({err}): the env-var contract cannot be checked")
    known = getattr(serving, "KNOWN_ENV_VARS", None)
    assert known, "rlhf.serving.KNOWN_ENV_VARS is missing or empty"
    return tuple(known)


def unknown_env(names: Iterable[str]) -> list[str]:
    """Names that are neither RLHF settings the code reads nor documented non-RLHF variables."""
    known = set(known_env_vars())
    return sorted({n for n in names if n not in known and n not in NON_RLHF_ENV})


def rlhf_parser() -> argparse.ArgumentParser:
    try:
        cli = importlib.import_module("services.cli")
    except ImportError as err:  # written concurrently; this assertion stays and passes once it lands
        pytest.fail(f"services.cli is not importable ({err}): container commands cannot be checked")
    build = getattr(cli, "build_parser", None)
    assert callable(build), "services.cli has no build_parser() returning the `rlhf` ArgumentParser"
    return build()


def parse_rlhf(argv: list[str]) -> argparse.Namespace:
    """Parse `rlhf ARGS` (argv without the program name) as the CLI would; argparse's exit becomes a test failure."""
    parser = rlhf_parser()
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`rlhf {' '.join(argv)}` is rejected by the rlhf CLI's parser")


def parse_container_command(argv: list[str]) -> argparse.Namespace:
    """A container's full command (`rlhf ...` or `torchrun ... -m services.cli ...`) -> the rlhf CLI's namespace."""
    assert argv, "empty container command"
    if argv[0] == "rlhf":
        return parse_rlhf(argv[1:])
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser  # noqa: PLC0415 - torch: only for a torchrun command line, the deploy checks load no torch otherwise

        try:
            tr = get_args_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"torchrun rejects {argv[1:]}")
        assert tr.module and tr.training_script == "services.cli", (
            f"torchrun must run the rlhf CLI as a module (-m services.cli), got {tr.training_script}"
        )
        return parse_rlhf(list(tr.training_script_args))
    pytest.fail(f"container command {argv} runs neither rlhf nor torchrun")
