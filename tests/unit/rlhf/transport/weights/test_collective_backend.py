"""The collective push's backend: picked by the trainer's device, carried in the group, refused by a replica that
cannot run it (rlhf.transport.weights.collective). CPU torch here: nccl and hccl are the impossible ones."""

from __future__ import annotations

import datetime
import os

import grpc
import pytest
import torch

import rlhf.transport.weights.collective as collective
from rlhf.serving import ServiceSettings
from rlhf.serving.errors import status_for
from rlhf.transport.weights.collective import (
    GroupSpec,
    TrainerGroup,
    backend_for,
    check_backend,
    trainer_backend,
)
from rlhf.transport.weights.errors import CollectiveUnavailable
from rlhf.v1 import weights_pb2


def test_backend_by_device_type():
    assert [backend_for(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(ValueError, match="mps"):
        backend_for("mps")


def test_trainer_picks_by_device_and_refuses_what_it_cannot_run():
    assert trainer_backend("auto", torch.device("cpu")) == ("gloo", None)
    assert trainer_backend("gloo", torch.device("cpu")) == ("gloo", None)
    with pytest.raises(ValueError, match=r"RLHF_WEIGHTS_COLLECTIVE_BACKEND=nccl.*needs a cuda device.*on cpu"):
        trainer_backend("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"RLHF_WEIGHTS_COLLECTIVE_BACKEND=hccl.*needs a npu device"):
        trainer_backend("hccl", torch.device("cpu"))
    if not torch.cuda.is_available():  # a CUDA model on this torch: nccl is named as missing, not silently gloo
        with pytest.raises(ValueError, match="no usable NCCL"):
            trainer_backend("auto", torch.device("cuda"))


def test_replica_check_names_the_backend_and_what_it_has():
    check_backend("gloo", "cpu")
    check_backend("gloo", "cuda")  # gloo lands in host memory: any engine can join
    with pytest.raises(CollectiveUnavailable) as err:
        check_backend("nccl", "cpu")
    assert "nccl" in str(err.value) and "on cpu" in str(err.value) and err.value.field == "group.backend"
    assert status_for(err.value) == (grpc.StatusCode.FAILED_PRECONDITION, 409)
    with pytest.raises(CollectiveUnavailable, match="torch_npu is not installed"):
        check_backend("hccl", "npu")
    with pytest.raises(CollectiveUnavailable, match="unknown backend"):
        check_backend("mpi", "cpu")


def test_group_spec_carries_the_backend():
    spec = GroupSpec("10.0.0.1", 1234, "k", 5.0, "nccl")
    assert GroupSpec.from_proto(spec.to_proto()) == spec
    # a trainer from before the field: gloo, as it built
    legacy = weights_pb2.CollectiveGroup(address="10.0.0.1", port=1234, key="k")
    assert GroupSpec.from_proto(legacy).backend == "gloo"
    with pytest.raises(ValueError, match="group.backend 'mpi'"):
        GroupSpec.from_proto(weights_pb2.CollectiveGroup(address="a", port=1, key="k", backend="mpi"))


def test_trainer_group_needs_a_device_exactly_for_device_backends():
    with pytest.raises(ValueError, match="needs a device"):
        TrainerGroup("127.0.0.1", 5.0, "nccl", None)
    with pytest.raises(ValueError, match="needs no device"):
        TrainerGroup("127.0.0.1", 5.0, "gloo", torch.device("cpu"))
    g = TrainerGroup("127.0.0.1", 5.0)
    try:
        assert g.spec.backend == "gloo" and g.spec.to_proto().backend == "gloo"
    finally:
        g.close()


def test_settings_validate_the_backend_variable():
    s = ServiceSettings.from_env({"RLHF_WEIGHTS_TRANSPORT": "collective", "RLHF_WEIGHTS_COLLECTIVE_BACKEND": "NCCL"})
    assert s.weights_collective_backend == "nccl"
    assert ServiceSettings.from_env({}).weights_collective_backend == "auto"
    with pytest.raises(ValueError, match="RLHF_WEIGHTS_COLLECTIVE_BACKEND"):
        ServiceSettings.from_env({"RLHF_WEIGHTS_TRANSPORT": "collective", "RLHF_WEIGHTS_COLLECTIVE_BACKEND": "mpi"})
    # set without the collective transport it would be ignored: refused, naming both variables
    with pytest.raises(ValueError, match=r"BACKEND=nccl only applies with RLHF_WEIGHTS_TRANSPORT"):
        ServiceSettings.from_env({"RLHF_WEIGHTS_COLLECTIVE_BACKEND": "nccl"})


class _FakeNccl:
    """Stands in for ``dist.ProcessGroupNCCL`` (CPU torch has none): records what the weight group is built with."""

    built: list = []

    class Options:
        def __init__(self):
            self._timeout = None
            self.config = type("NCCLConfig", (), {"blocking": -2147483648})()  # NCCL_CONFIG_UNDEF_INT

    def __init__(self, store, rank, world, options):
        _FakeNccl.built.append((rank, world, options))


@pytest.mark.parametrize("env", [None, "0"])
def test_the_nccl_weight_group_is_non_blocking_with_its_init_bounded(monkeypatch, env):
    """F5: NCCL forms the communicator at the first broadcast, outside its per-collective timeout; a non-blocking
    communicator makes that init time out (TORCH_NCCL_NONBLOCKING_TIMEOUT, the group's timeout unless set) and
    abortable. TORCH_NCCL_USE_COMM_NONBLOCKING=0 keeps it blocking. The per-collective timeout is past the trainer's
    watchdog, which aborts first (NCCL's own tears the process down by default)."""
    monkeypatch.setattr(collective.dist, "ProcessGroupNCCL", _FakeNccl, raising=False)
    for var, value in (("TORCH_NCCL_NONBLOCKING_TIMEOUT", None), ("TORCH_NCCL_USE_COMM_NONBLOCKING", env)):
        monkeypatch.setenv(var, "x")  # recorded, so the value the code sets is undone after the test
        if value is None:
            monkeypatch.delenv(var)
        else:
            monkeypatch.setenv(var, value)
    _FakeNccl.built.clear()
    store = torch.distributed.HashStore()
    collective._process_group(store, 1, 3, GroupSpec("127.0.0.1", 1, "k", 7.5, "nccl"), "127.0.0.1")
    rank, world, options = _FakeNccl.built[0]
    assert (rank, world) == (1, 3)
    assert options.config.blocking == (0 if env is None else -2147483648)
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "8"
    grace = collective.WATCHDOG_GRACE_S + collective.NCCL_TIMEOUT_GRACE_S
    assert options._timeout == datetime.timedelta(seconds=7.5 + grace)
