"""The pure logic of the cluster harness (tests/cluster/netns.py): the address plan and the subnet-in-use check.
Nothing here touches the machine's network."""

from __future__ import annotations

import pytest

from tests.cluster import netns


def test_address_plan_leaves_the_bridge_first_and_hosts_in_order():
    bridge, hosts = netns.plan_addresses(["a", "b", "c"], "10.213.7.0/24")
    assert bridge == "10.213.7.1"
    assert hosts == {"a": "10.213.7.11", "b": "10.213.7.12", "c": "10.213.7.13"}


def test_address_plan_refuses_repeats_and_overflow():
    with pytest.raises(ValueError, match="repeat"):
        netns.plan_addresses(["a", "a"])
    with pytest.raises(ValueError, match="do not fit"):
        netns.plan_addresses([f"h{i}" for i in range(10)], "10.0.0.0/28")


@pytest.mark.parametrize(
    ("in_use", "hit"),
    [
        (["192.0.2.2/24", "default", "192.0.2.0/24", "127.0.0.1/8"], []),
        (["10.213.7.5/24"], ["10.213.7.5/24"]),  # an address inside it
        (["10.213.0.0/16"], ["10.213.0.0/16"]),  # a route that covers it
        (["10.213.7.128/25"], ["10.213.7.128/25"]),  # a route inside it
        (["10.213.8.0/24", "fd00::2/64", "not an address", ""], []),
    ],
)
def test_subnet_in_use(in_use, hit):
    assert netns.overlapping("10.213.7.0/24", in_use) == hit


def test_host_names():
    assert netns.valid_name("rollout-0")
    assert not netns.valid_name("bad name")
    assert not netns.valid_name("")


def test_network_plan_names_links_within_linux_limits():
    net = netns.Network(["redis-a", "trainer-1"])
    assert [h.veth for h in net.hosts.values()] == ["rlhfc-v0", "rlhfc-v1"]
    assert all(len(n) <= 15 for n in [net.bridge, net.side_b, *(h.veth for h in net.hosts.values())])
    assert net.host("trainer-1").wrap(["true"]) == ["ip", "netns", "exec", "rlhfc-trainer-1", "true"]


def test_scale_trigger_is_the_hpa_arithmetic():
    """make scale-check's driver: desired = ceil(metric / target) clamped to [min, max], no change within the 10%
    tolerance, up at once, down only to the highest recommendation of the stabilization window."""
    from tests.cluster.triggers import Trigger  # noqa: PLC0415 - the harness module: imported where it is tested

    t = Trigger("rollout", target=4.0, min_replicas=1, max_replicas=3, window_s=20.0)
    assert t.raw(12, 1) == 3 and t.raw(30, 1) == 3  # clamped to max
    assert t.raw(0, 3) == 1 and t.raw(5, 1) == 2  # clamped to min; ceil
    assert t.raw(8.5, 2) == 2  # 8.5 / (4 * 2) = 1.06: within the tolerance, no change
    assert t.desired(12, 1, now=0.0) == 3  # up at once
    assert t.desired(0, 3, now=5.0) == 3  # down: the window still holds the 3
    assert t.desired(0, 3, now=19.0) == 3
    assert t.desired(0, 3, now=21.0) == 1  # the 3 (t=0) left the window; the zeros since recommend 1
    assert t.desired(6, 1, now=22.0) == 2


def test_scale_drivers_metrics_are_the_charts_expressions():
    """rollout: held + waiting; reward: sum over the replicas in the Service of each one's mean in-flight count over
    the window (avg_over_time), a replica's scrapes outside the window left out."""
    from tests.cluster import triggers  # noqa: PLC0415 - the harness module: imported where it is tested

    assert triggers.rollout_metric(held=4, waiting=7) == 11
    w = triggers.REWARD_WINDOW_S
    samples = {"reward-0": [(100 - w - 1, 50.0), (98.0, 2.0), (100.0, 4.0)], "reward-1": [(99.0, 1.0)], "r2": []}
    assert triggers.reward_metric(samples, now=100.0) == 3.0 + 1.0
    assert triggers.reward_metric({}, now=100.0) == 0.0


def test_scale_round_trip_needs_the_maximum_then_one_after_it():
    """make scale-check passes only if a service served at its maximum and, later, at 1: a fleet that stopped at 2
    (the chart's rollout trigger while the trainer admits a batch a step) or was at 1 only before the maximum fails."""
    from tests.cluster.scale import round_trip  # noqa: PLC0415 - the harness module: imported where it is tested

    assert round_trip([1, 1, 2, 3, 3, 2, 1], top=3)
    assert not round_trip([1, 3, 2, 3, 2], top=3)  # never back to 1
    assert not round_trip([1, 2, 2, 1], top=3)  # never at 3
    assert round_trip([1, 2, 1], top=2)
