"""services.trainer.fleet.Fleet._deliver: a per-step push skips the replicas whose last push failed while another
replica is current (the catch-up loop pushes to them once they answer), and goes to every replica when all failed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rlhf.serving import ServiceSettings
from services.trainer.fleet import Fleet

A, B, C = "127.0.0.1:50001", "127.0.0.1:50002", "127.0.0.1:50003"


def deliver(lagging: dict[str, tuple[int, str]]) -> tuple[list[list[str]], list[tuple]]:
    pushed_to: list[list[str]] = []
    published: list[tuple] = []

    async def pushed(version, jobs):
        published.append((version, jobs))

    async def main() -> None:
        settings = ServiceSettings(api_token="t", rollout_addrs=[A, B, C])
        publisher = SimpleNamespace(pushed=pushed)
        fleet = Fleet(
            settings, SimpleNamespace(policy_version=7, group=None), publisher, asyncio.Lock(), None, print, {}
        )
        fleet._lagging = dict(lagging)

        async def push_to(addrs, packed, delta_ok=True):  # the transport is tested elsewhere: record the choice
            pushed_to.append(list(addrs))
            return packed.version

        fleet._push_to = push_to
        await fleet._deliver(SimpleNamespace(version=7), jobs=3)

    asyncio.run(main())
    return pushed_to, published


def test_a_replica_whose_last_push_failed_is_left_to_the_catch_up_loop():
    pushed_to, published = deliver({B: (6, "connection refused")})
    assert pushed_to == [[A, C]]
    assert published == [(7, 3)]  # the version goes out on the replicas that took it


def test_every_replica_is_tried_when_none_is_current():
    pushed_to, _ = deliver({A: (6, "cut"), B: (6, "cut"), C: (5, "cut")})
    assert pushed_to == [[A, B, C]]


def test_no_lagging_replica_means_a_push_to_all():
    pushed_to, _ = deliver({})
    assert pushed_to == [[A, B, C]]
