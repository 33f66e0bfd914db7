"""Hosts on one machine: Linux network namespaces joined by a bridge, and the faults a network can have.

::

    net = Network(["redis-0", "trainer-0", ...]).create()   # refuses when its subnet or names are taken
    net.host("redis-0").ip                                  # 10.213.7.11
    net.host("redis-0").wrap(["redis-server", ...])         # argv that runs inside that host
    net.cut("redis-0"); net.restore("redis-0")              # its cable pulled, and back
    net.partition(["redis-1", "redis-2"]); net.heal()       # two sides that cannot reach each other
    net.destroy()                                           # every namespace and link it made (also cleanup())

Each host is a namespace ``<prefix>-<name>`` with its loopback and one veth (``eth0`` inside, ``<prefix>-v<i>`` on
the machine's side) on the bridge ``<prefix>-br0``, which holds the harness's own address (``.1``) so that it can
watch the hosts. Nothing is routed out: the namespaces get no default route and forwarding is not touched. This
machine's ``tc netem`` does not work, so every fault is a link state: a cut host's veth is down (packets go
nowhere, as with a pulled cable), and a partition moves one side's veths to a second bridge with no address.

Everything the module makes carries the prefix, so :func:`cleanup` finds leftovers of a killed run by name.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREFIX = "rlhfc"
SUBNET = "10.213.7.0/24"  # private, owned by the harness; refused when anything on the machine uses it
FIRST_HOST = 11  # .1 is the bridge (the harness), .2-.10 are left free


def ip(*args: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")
    return res


# ------------------------------------------------------------ pure logic (tests/unit/test_cluster_harness.py)


def plan_addresses(names: Sequence[str], subnet: str = SUBNET) -> tuple[str, dict[str, str]]:
    """The bridge's address and each host's, in the given order, inside ``subnet``."""
    net = ipaddress.ip_network(subnet)
    hosts = list(net.hosts())
    if len(set(names)) != len(names):
        raise ValueError(f"host names repeat: {list(names)}")
    if FIRST_HOST + len(names) > len(hosts):
        raise ValueError(f"{len(names)} hosts do not fit in {subnet}")
    return str(hosts[0]), {n: str(hosts[FIRST_HOST - 1 + i]) for i, n in enumerate(names)}


def overlapping(subnet: str, in_use: Iterable[str]) -> list[str]:
    """The networks of ``in_use`` (addresses with prefix length, or routes' destinations; ``default`` is skipped)
    that overlap ``subnet``."""
    net = ipaddress.ip_network(subnet)
    out = []
    for item in in_use:
        if item in ("default", ""):
            continue
        try:
            other = ipaddress.ip_network(item, strict=False)
        except ValueError:
            continue
        if other.version == net.version and other.overlaps(net):
            out.append(item)
    return out


def valid_name(name: str, prefix: str = PREFIX) -> bool:
    """A host name that fits a namespace name and whose links stay within Linux's 15 characters."""
    return bool(name) and all(c.isalnum() or c == "-" for c in name) and len(f"{prefix}-{name}") <= 64


# ------------------------------------------------------------ the machine's state


def addresses_and_routes() -> list[str]:
    """Every IPv4 address (with its prefix) and route destination of the machine's own namespace."""
    out = []
    for link in json.loads(ip("-j", "-4", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            out.append(f"{a['local']}/{a['prefixlen']}")
    for r in json.loads(ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        out.append(r.get("dst", ""))
    return out


def namespaces(prefix: str = PREFIX) -> list[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def links(prefix: str = PREFIX) -> list[str]:
    out = []
    for link in json.loads(ip("-j", "link").stdout or "[]"):
        if link["ifname"].startswith(prefix + "-"):
            out.append(link["ifname"])
    return out


def netns_pids(ns: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def kill_namespace_processes(ns: str, grace_s: float = 3.0, first: int = signal.SIGTERM) -> int:
    """``first`` (SIGTERM), then after ``grace_s`` SIGKILL, to every process inside ``ns``; returns how many were
    still there at the end."""
    pids = netns_pids(ns)
    for sig, wait in ((first, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while netns_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = netns_pids(ns)
        if not pids:
            break
    return len(pids)


def cleanup(prefix: str = PREFIX, say=print) -> list[str]:
    """Remove what a run with ``prefix`` left: the processes in its namespaces, the namespaces, its links (veths and
    bridges). Returns what was removed."""
    removed = []
    for ns in namespaces(prefix):
        kill_namespace_processes(ns, grace_s=1.0)
        ip("netns", "del", ns, check=False)
        removed.append(ns)
    for link in links(prefix):  # a veth's machine side goes with its namespace; bridges and stragglers here
        if ip("link", "del", link, check=False).returncode == 0:
            removed.append(link)
    if removed:
        say(f"cleanup: removed {', '.join(removed)}")
    return removed


# ------------------------------------------------------------ the network


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    veth: str  # the machine-side end

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (its network namespace; the file system is the machine's, as a shared
        volume would be)."""
        return ["ip", "netns", "exec", self.ns, *argv]


class Network:
    def __init__(
        self, names: Sequence[str], subnet: str = SUBNET, prefix: str = PREFIX, sysctls: dict[str, str] | None = None
    ):
        bad = [n for n in names if not valid_name(n, prefix)]
        if bad:
            raise ValueError(f"bad host names: {bad}")
        self.prefix = prefix
        self.subnet = subnet
        self.prefixlen = ipaddress.ip_network(subnet).prefixlen
        self.bridge_ip, addrs = plan_addresses(names, subnet)
        self.bridge = f"{prefix}-br0"
        self.side_b = f"{prefix}-br1"  # the other side of a partition: no address, the harness cannot see it
        self.hosts = {n: Host(n, f"{prefix}-{n}", addrs[n], f"{prefix}-v{i}") for i, n in enumerate(names)}
        self.created = False
        self.partitioned: list[str] = []
        self.sysctls = dict(sysctls or {})  # per host (namespaced ones: net.ipv4.tcp_*), as a pod's securityContext

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def refuse_if_taken(self) -> None:
        left = namespaces(self.prefix) + links(self.prefix)
        if left:
            raise RuntimeError(
                f"leftovers of an earlier run (or one still running): {', '.join(left)}; remove them with "
                "`python -m tests.cluster.run --cleanup`"
            )
        taken = overlapping(self.subnet, addresses_and_routes())
        if taken:
            raise RuntimeError(f"subnet {self.subnet} is already in use on this machine ({', '.join(taken)}): refusing")

    def create(self) -> Network:
        self.refuse_if_taken()
        self.created = True  # from here on destroy() has something to do, even if a step below fails
        for br in (self.bridge, self.side_b):
            ip("link", "add", br, "type", "bridge")
            ip("link", "set", br, "up")
        ip("addr", "add", f"{self.bridge_ip}/{self.prefixlen}", "dev", self.bridge)
        for h in self.hosts.values():
            ip("netns", "add", h.ns)
            ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            ip("link", "set", h.veth, "master", self.bridge)
            ip("link", "set", h.veth, "up")
            ip("link", "set", "lo", "up", ns=h.ns)
            ip("addr", "add", f"{h.ip}/{self.prefixlen}", "dev", "eth0", ns=h.ns)
            ip("link", "set", "eth0", "up", ns=h.ns)
            for key, value in self.sysctls.items():
                path = "/proc/sys/" + key.replace(".", "/")
                subprocess.run(h.wrap(["sh", "-c", f"echo {value} > {path}"]), check=True)
        return self

    def wait_reachable(self, timeout: float = 10.0) -> None:
        """Until every host reaches the harness's address (no ping here: a TCP connect to a closed port that is
        refused has crossed the link)."""
        probe = (
            "import socket,sys\n"
            "try: socket.create_connection((sys.argv[1], 9), timeout=1)\n"
            "except ConnectionRefusedError: sys.exit(0)\n"
            "except OSError: sys.exit(1)\n"
        )
        deadline = time.monotonic() + timeout
        for h in self.hosts.values():
            while subprocess.run(h.wrap(["python3", "-c", probe, self.bridge_ip]), capture_output=True).returncode:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"host {h.name} ({h.ip}) cannot reach the bridge")
                time.sleep(0.2)

    # ------------------------------------------------------------ faults
    def cut(self, name: str) -> None:
        """The host's cable pulled: its veth down on the machine's side (its end sees no carrier)."""
        ip("link", "set", self.hosts[name].veth, "down")

    def restore(self, name: str) -> None:
        ip("link", "set", self.hosts[name].veth, "up")

    def partition(self, side_b: Iterable[str]) -> None:
        """Move ``side_b``'s hosts to the second bridge: each side reaches only its own (the harness stays on the
        first)."""
        for n in side_b:
            ip("link", "set", self.hosts[n].veth, "master", self.side_b)
            self.partitioned.append(n)

    def heal(self) -> None:
        for n in self.partitioned:
            ip("link", "set", self.hosts[n].veth, "master", self.bridge)
        self.partitioned = []

    def destroy(self) -> None:
        if self.created:
            cleanup(self.prefix, say=lambda s: None)
            self.created = False


def link_stats(host: Host) -> tuple[int, int]:
    """(rx bytes, tx bytes) of the host's eth0 so far."""
    res = ip("-j", "-s", "link", "show", "eth0", ns=host.ns)
    s = json.loads(res.stdout)[0]["stats64"]
    return int(s["rx"]["bytes"]), int(s["tx"]["bytes"])
