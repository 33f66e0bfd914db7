"""The collective push's backend: picked by the trainer's device, carried in the group, refused by a replica that
cannot run it (rlhf.transport.weights.collective). CPU torch here: nccl and hccl are the impossible ones."""

from __future__ import annotations

import grpc
import pytest
import torch

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
