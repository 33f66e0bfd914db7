"""rlhf.procs picks a service's ports so that they differ, even where the OS hands out a freed port again at once."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf import procs


class _LowestFreePort:
    """A socket whose bind(port 0) takes the lowest port no open socket of this kind holds (as an OS that reuses a
    freed port at once would), and frees it on close."""

    held: set[int] = set()

    def __init__(self, *args, **kwargs):
        self.port = None

    def bind(self, address):
        host, port = address
        if port == 0:
            port = next(p for p in range(40000, 40100) if p not in self.held)
        self.port = port
        self.held.add(port)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def close(self):
        self.held.discard(self.port)


def test_ports_are_drawn_outside_the_kernels_ephemeral_range():
    # an outgoing connection's local port comes from that range, so a port picked there can be taken between the
    # pick and the child's bind (a CI run lost `rlhf up --resume` to it)
    lo, hi = procs._ephemeral_range()
    ports = procs.free_ports(40)
    assert len(set(ports)) == 40
    assert all(1024 <= p < lo or p > hi for p in ports), (lo, hi, ports)


def test_a_services_two_ports_differ_when_the_os_reuses_a_freed_port(monkeypatch, tmp_path):
    monkeypatch.setattr(procs, "socket", SimpleNamespace(socket=_LowestFreePort))
    # no port outside the ephemeral range: the kernel's pick (bind to port 0) is the fallback
    monkeypatch.setattr(procs, "_ephemeral_range", lambda: (1024, 65535))
    assert procs.free_port() == procs.free_port() == 40000  # the fake does reuse a freed port
    assert procs.free_ports(3) == [40000, 40001, 40002]
    svc = procs.ServiceProc("reward", tmp_path / "c.yaml", tmp_path)
    assert svc.grpc_port != svc.http_port  # a service whose two servers share a port cannot start
    kept = procs.ServiceProc("reward", tmp_path / "c.yaml", tmp_path, grpc_port=50051, http_port=8001)
    assert (kept.grpc_port, kept.http_port) == (50051, 8001)
    one = procs.ServiceProc("reward", tmp_path / "c.yaml", tmp_path, grpc_port=50051)
    assert one.grpc_port == 50051 and one.http_port not in (0, 50051)
