"""The checked-in generated protobuf/gRPC code under rlhf/v1 is fresh, importable and matches the wire contract."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from rlhf import protogen
from rlhf.v1 import rollout_pb2

CHECKED_IN = protogen.ROOT / "rlhf" / "v1"


def _generated_names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if "_pb2" in p.name and p.name.endswith((".py", ".pyi"))}


def test_generated_code_is_fresh(tmp_path):
    generated = protogen.generate(tmp_path)
    out = tmp_path / "rlhf" / "v1"
    assert generated, "protogen.generate produced nothing"
    hint = "the generated code in rlhf/v1 is stale: run `make proto` and commit the result"
    new, old = _generated_names(out), _generated_names(CHECKED_IN)
    assert new == old, f"{hint} (missing: {sorted(new - old)}, extra: {sorted(old - new)})"
    stale = [name for name in sorted(new) if (out / name).read_bytes() != (CHECKED_IN / name).read_bytes()]
    assert not stale, f"{hint} (differs: {stale})"


def test_every_proto_has_generated_modules():
    names = _generated_names(CHECKED_IN)
    protos = protogen.proto_files()
    assert {p.stem for p in protos} >= {"common", "rollout", "reward", "reference", "experience", "trainer"}
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert proto.stem + suffix in names


SERVICES = {
    "rollout": (
        "RolloutService",
        {
            "Generate",
            "UpdateWeights",
            "OpenWeightsTransfer",
            "CommitWeights",
            "AbortWeightsTransfer",
            "GetWeightsVersion",
            "LoadAdapter",
        },
    ),
    "reward": ("RewardService", {"Score"}),
    "reference": ("ReferenceService", {"LogProbs"}),
    "trainer": ("TrainerService", {"Status", "Checkpoint", "Pause", "Resume"}),
}


@pytest.mark.parametrize("module", sorted(SERVICES))
def test_services_and_rpcs(module):
    service, rpcs = SERVICES[module]
    pb2 = importlib.import_module(f"rlhf.v1.{module}_pb2")
    grpc_mod = importlib.import_module(f"rlhf.v1.{module}_pb2_grpc")
    assert pb2.DESCRIPTOR.package == "rlhf.v1"
    desc = pb2.DESCRIPTOR.services_by_name[service]
    assert desc.full_name == f"rlhf.v1.{service}"
    assert {m.name for m in desc.methods} == rpcs
    assert hasattr(grpc_mod, f"{service}Stub")
    assert hasattr(grpc_mod, f"add_{service}Servicer_to_server")
    servicer = getattr(grpc_mod, f"{service}Servicer")
    for rpc in rpcs:
        assert callable(getattr(servicer, rpc))


def test_update_weights_is_client_streaming():
    methods = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name
    assert methods["UpdateWeights"].client_streaming and not methods["UpdateWeights"].server_streaming
    unary = (
        "Generate",
        "GetWeightsVersion",
        "OpenWeightsTransfer",
        "CommitWeights",
        "AbortWeightsTransfer",
        "LoadAdapter",
    )
    for name in unary:
        assert not methods[name].client_streaming and not methods[name].server_streaming


def test_all_generated_modules_import():
    for name in sorted(_generated_names(CHECKED_IN)):
        if name.endswith(".py"):
            mod = importlib.import_module(f"rlhf.v1.{name[:-3]}")
            assert mod.__name__.startswith("rlhf.v1.")
