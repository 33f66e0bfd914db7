"""``device: auto`` on an Ascend machine: torch_npu importable and an NPU present -> npu; otherwise cuda or cpu.
torch_npu itself is not installed here (it breaks CPU-only torch), so a stub module stands in for it."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from rlhf import models


@pytest.fixture(autouse=True)
def _no_stub_left_in_sys_modules():
    """The stub's import puts a torch_npu in sys.modules that monkeypatch does not take out (it was absent before):
    remove it, or a later test in the run (test_collective_backend's hccl check) imports the stub."""
    before = sys.modules.get("torch_npu")
    yield
    if before is None:
        sys.modules.pop("torch_npu", None)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _stub_torch_npu(monkeypatch, available: bool, fail: Exception | None = None):
    """A torch_npu that does what the real one does on import: register ``torch.npu``."""
    imported = []

    class Finder:  # imports of "torch_npu" run this stub's "module code"
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != "torch_npu":
                return None
            return importlib.machinery.ModuleSpec(name, Loader)

    class Loader:
        @staticmethod
        def create_module(spec):
            return types.ModuleType("torch_npu")

        @staticmethod
        def exec_module(module):
            imported.append(module)
            if fail is not None:
                raise fail
            monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: available), raising=False)

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Finder, *sys.meta_path])
    return imported


def test_auto_picks_the_npu_when_torch_npu_reports_one(monkeypatch, no_cuda):
    imported = _stub_torch_npu(monkeypatch, available=True)
    assert models.auto_device_type() == "npu"
    assert imported  # decided by importing torch_npu, not by an environment variable


def test_auto_stays_on_cpu_without_an_npu(monkeypatch, no_cuda):
    _stub_torch_npu(monkeypatch, available=False)
    assert models.auto_device_type() == "cpu"


def test_auto_stays_on_cpu_when_torch_npu_cannot_load(monkeypatch, no_cuda, caplog):
    _stub_torch_npu(monkeypatch, available=True, fail=RuntimeError("libascendcl.so: cannot open shared object file"))
    assert models.auto_device_type() == "cpu"
    assert "libascendcl" in caplog.text


def test_auto_without_torch_npu_installed(monkeypatch, no_cuda):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    assert models.auto_device_type() == "cpu"  # this machine: no torch_npu
    assert models.resolve_device("auto") == torch.device("cpu")


def test_cuda_comes_first(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _stub_torch_npu(monkeypatch, available=True)
    assert models.auto_device_type() == "cuda"
