"""The rollout replicas as the trainer sees them: the ``Fleet``.

It finds every replica behind the configured addresses (:func:`expand_targets`: a compose service or a headless
Service resolves to one address per replica), pushes the policy to them (after a step, overlapped with the next one;
at start-up; to a replica that fell behind: the catch-up loop), records which version each one took, and says when
the ring must wait because no replica serves the newest weights. A refusal no retry can fix stops the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from rlhf import runlog
from rlhf.serving import ServiceSettings, open_channel
from rlhf.serving.runner import client_credentials
from rlhf.transport import BufferPool, copy_weights, push_weights_many, push_weights_streamed
from rlhf.transport.weights.collective import trainer_backend
from rlhf.transport.weights.delta import make_delta
from rlhf.transport.weights.errors import is_final_refusal
from rlhf.v1 import rollout_pb2_grpc, weights_pb2

if TYPE_CHECKING:
    from services.trainer.engine import TrainerEngine
    from services.trainer.publisher import Publisher

log = logging.getLogger("rlhf.trainer")


def collective_backend(settings: ServiceSettings, device) -> dict:
    """The collective push's backend and device, when ``weights_transport`` is collective: a backend this trainer
    cannot run is refused at start-up."""
    if settings.weights_transport != "collective":
        return {}

    backend, device = trainer_backend(settings.weights_collective_backend, device)
    return {"backend": backend, "device": device}


class Fleet:
    def __init__(
        self,
        settings: ServiceSettings,
        engine: TrainerEngine,
        publisher: Publisher,
        state_lock: asyncio.Lock,
        events: Path,
        stop_ring: Callable[[str], None],  # stops the run: raises runlog.StoppedByRule
        collective: dict,
    ):
        self.settings, self.engine, self.publisher = settings, engine, publisher
        # The trainer's lock on its weights: a push between steps sends the weights of one version.
        self._state_lock = state_lock
        self._events, self._stop_ring = events, stop_ring
        self._collective = collective  # the collective push's backend and device (collective_backend)
        self._push_task: asyncio.Task | None = None
        # Bucket buffers of the per-step pushes, reused once a push no longer holds them: fresh memory costs a page
        # fault per 4 KiB (bench.pipeline, docs/benchmarks.md: the pipeline section's change 8).
        self._push_buffers = BufferPool()
        # Delta pushes (RLHF_WEIGHTS_DELTA=auto): the last update a replica took, kept (one more copy of the policy
        # in host memory) so the next push sends each replica only what changed since; None: the next goes in full.
        self._delta_base = None
        # Replicas whose last push failed: address -> (version, the error). While none serves the newest version the
        # ring waits (see waiting) instead of cycling jobs that the old weights would make too stale to train.
        self._lagging: dict[str, tuple[int, str]] = {}
        self._replicas: set[str] = set()  # every replica of the last push to all
        self._announced: set[tuple[str, int]] = set()  # (replica, version) catch-up pushes already logged
        self.waiting: str | None = None  # why the ring waits for a replica, or None

    # ------------------------------------------------------------------ pushes
    async def push_step(self, jobs: int) -> None:
        """Push the weights of the step just trained, which carry the training of ``jobs``. Call :meth:`settle`
        first: versions reach replicas in order, and the trained count that frees admission only grows."""
        if self.engine.group is None:
            # The weights copied into the push's buckets now (the next step changes them; the NaN check and one copy
            # into buffers reused from an earlier push); hashing them and the push (transfer + the replicas' swap)
            # then overlap the next step instead of stalling it.
            version = self.engine.policy_version
            packed = await asyncio.to_thread(self._copy_policy, version)
            self._push_task = asyncio.create_task(self._seal_and_deliver(packed, jobs=jobs))
        else:
            # A trainer group streams the push (never the whole policy on rank 0): the weights must stay as they are
            # until it is done, so the next step waits for it (the caller holds the state lock).
            await self._deliver(None, jobs=jobs)

    async def settle(self) -> None:
        """Wait for the weight push in flight, if any (its failure ends training like any other)."""
        task, self._push_task = self._push_task, None
        if task is not None:
            await task

    @property
    def push_task(self) -> asyncio.Task | None:
        """The push in flight (one process: it overlaps the next step), if any."""
        return self._push_task

    async def push_current(self) -> None:
        """Push the weights held now to every replica (start-up: the restored weights, under their new version)."""
        if not await asyncio.to_thread(expand_targets, self.settings.rollout_addrs):
            return
        if self.engine.group is None:
            await self._deliver(await self._pack())
            return
        async with self._state_lock:
            await self._deliver(None)

    async def _pack(self):
        """The live policy packed at its version."""
        version = self.engine.policy_version
        return await asyncio.to_thread(lambda: self._copy_policy(version).seal())

    def _copy_policy(self, version: int):
        """The live policy copied into push buckets as ``version`` (not yet hashed: :meth:`_seal_and_deliver`):
        one copy per tensor, into host buckets, or, for a collective push over nccl/hccl, into buckets on the
        trainer's device (broadcast from there and checked there by the replicas: no host copy on either side)."""
        weights = self.engine.policy_state_dict(on_device=True)
        device = self._collective.get("device")  # None: host buckets (tcp, grpc, gloo)
        if device is not None:
            return copy_weights(weights, version, version - 1, device=device)
        return copy_weights(weights, version, version - 1, pool=self._push_buffers)

    async def _seal_and_deliver(self, packed, jobs: int) -> None:
        # A refusal that stops the run ends this push quietly: stop_ring said why and cancelled the step that would
        # settle it.
        with contextlib.suppress(runlog.StoppedByRule):
            await self._deliver(await asyncio.to_thread(packed.seal), jobs=jobs)

    async def _deliver(self, packed, jobs: int = 0) -> None:
        """Push ``packed`` to every replica, then let the publisher publish its version and admit the ``jobs`` whose
        training it carries. ``packed`` None: a trainer group streams the current weights (see :meth:`_push_to`;
        hold the state lock)."""
        addrs = await asyncio.to_thread(expand_targets, self.settings.rollout_addrs)
        version = None
        if addrs:
            self._replicas = set(addrs)
            # A replica whose last push failed (a host cut off, say) is left to the catch-up loop, which pushes to it
            # once it answers again: a push to it would wait out its connection deadline every step, and a trainer
            # group trains only after its push (make cluster-check's rollout_cut: docs/reliability.md, its figures).
            healthy = [a for a in addrs if a not in self._lagging]
            version = await self._push_to(healthy or addrs, packed)
        await self.publisher.pushed(version, jobs)

    def _delta_on(self, packed) -> bool:
        """Delta pushes apply: asked for, host buckets of one process, a transport that sends them (tcp, grpc)."""
        return (
            self.settings.weights_delta == "auto"
            and packed is not None
            and not packed.on_device
            and self.settings.weights_transport != "collective"
        )

    async def _push_to(self, addrs: list[str], packed, delta_ok: bool = True) -> int:
        """Push ``packed`` to ``addrs``, or with ``packed`` None (a trainer group; hold the state lock) stream the
        engine's current weights: gathered bucket by bucket, twice (the digests, then the bytes), so rank 0 holds
        one bucket, never the whole policy, and training waits for the push. Returns the version pushed.
        With delta pushes on, a replica that holds the last update gets only what changed since (``delta_ok``
        False: everyone gets the full update, as the catch-up of replicas that fell behind does)."""
        tls: dict = {}
        creds = client_credentials(self.settings)
        if creds is not None:  # TLS ring: verify each replica against its service's name, not its pod address
            names = await asyncio.to_thread(tls_names, self.settings.rollout_addrs)
            tls = {"tls": creds, "server_names": names}
        kw = {
            "token": self.settings.api_token,
            "timeout": 120.0,
            "transport": self.settings.weights_transport,
            **tls,
            **self._collective,
        }
        if packed is None:
            packed = self.engine.policy_stream(self.engine.policy_version)
            results = await push_weights_streamed(addrs, packed, **kw)
        else:
            delta_on = self._delta_on(packed)
            if delta_on:
                packed.header.keep_base = True  # each replica keeps what it takes as the base of the next delta
                if delta_ok and self._delta_base is not None:
                    kw["delta"], stats = await asyncio.to_thread(make_delta, self._delta_base, packed)
                    log.debug(
                        "version %d as a delta on %d: %d of %d bytes, %.4f of the words changed",
                        packed.version,
                        self._delta_base.version,
                        stats.wire_bytes,
                        stats.full_bytes,
                        stats.changed_fraction,
                    )
            results = await push_weights_many(addrs, packed, **kw)
            if delta_on and any(not isinstance(r, BaseException) for r in results.values()):
                self._delta_base = packed  # the replicas that took it hold it now
        self._note_push(packed.version, results)
        return packed.version

    # ------------------------------------------------------------------ replicas that fell behind
    async def catch_up_loop(self, done: Callable[[], bool], interval_s: float = 2.0) -> None:
        """Bring replicas that serve an older version than the run's published one up to date: a replica that
        started or restarted after a push (a crash, a scale-up) waits for this before it takes a job (see the
        rollout worker), so it never generates samples from weights many versions old."""
        while not done():
            await asyncio.sleep(interval_s)
            try:
                published = await self.publisher.admission.policy_version()
                addrs = await asyncio.to_thread(expand_targets, self.settings.rollout_addrs)
                if published is None or not addrs or (self._push_task is not None and not self._push_task.done()):
                    continue
                lagging = []
                names = await asyncio.to_thread(tls_names, self.settings.rollout_addrs)
                for addr in addrs:
                    channel = open_channel(addr, self.settings, server_name=names.get(addr))
                    try:
                        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                        served = await stub.GetWeightsVersion(weights_pb2.GetWeightsVersionRequest(), timeout=5)
                    except grpc.aio.AioRpcError:
                        continue  # down or starting: asked again next time
                    finally:
                        await channel.close()
                    if served.version < published:
                        lagging.append((addr, served.version))
                    elif addr in self._lagging:  # it loaded the newest weights itself (a restart from a checkpoint)
                        self._note_push(served.version, {addr: served})
                if not lagging:
                    continue
                targets = [a for a, _ in lagging]
                async with self._state_lock:  # between steps: the weights of one version
                    for addr, served in lagging:  # once per replica and version; the retries are quiet
                        key = (addr, published)
                        say = log.debug if key in self._announced else log.info
                        self._announced.add(key)
                        say(
                            "replica %s serves version %d, the run is at %d: pushing version %d",
                            addr,
                            served,
                            published,
                            self.engine.policy_version,
                        )
                    if self.engine.group is not None:  # streamed: the weights may not change until it is done
                        await self._push_to(targets, None)
                        continue
                    packed = await self._pack()
                await self._push_to(targets, packed, delta_ok=False)  # behind: no base to build on
            except asyncio.CancelledError:
                raise
            except runlog.StoppedByRule:
                return  # a refusal stopped the run; stop_ring said why
            except Exception as err:  # noqa: BLE001 - Redis restarting, a replica going away: try again later
                log.warning("catching up lagging replicas failed (%s: %s); retrying", type(err).__name__, err)

    def _note_push(self, version: int, results: dict) -> None:
        """Record which replicas took ``version``. A refusal no retry can fix stops the run at once; a replica that
        failed otherwise is retried by the catch-up loop, and while no replica serves the newest version the ring
        says it is waiting (one log line and one event per change of state, not one per record)."""
        final = {a: r for a, r in results.items() if isinstance(r, BaseException) and is_final_refusal(r)}
        if final:
            addr, err = next(iter(final.items()))
            self._stop_ring(
                f"replica {addr} refused version {version} of the weights, and no retry can change that: "
                f"{_error_text(err)}. The trainer pushes the policy in its checkpoint layout "
                f"(actor_rollout.load: {self.engine.cfg.actor.load}); the replica expects the tensors of the model it "
                "serves: give rollout the same model as the trainer, and an architecture `rlhf up` accepts"
            )
        for addr, res in results.items():
            if isinstance(res, BaseException):
                before = self._lagging.get(addr)
                self._lagging[addr] = (version, _error_text(res))
                if before is None or before[1] != self._lagging[addr][1]:
                    log.warning("weight sync to %s failed: %s", addr, res)
            elif addr in self._lagging:
                del self._lagging[addr]
                log.info("replica %s now serves version %d", addr, version)
        for addr in set(self._lagging) - self._replicas:  # gone since (scaled down, renamed)
            del self._lagging[addr]
        if not self._lagging or self._replicas - set(self._lagging):
            self._set_waiting(None)
        else:
            addr, (v, err) = next(iter(self._lagging.items()))
            self._set_waiting(f"waiting for {addr} to load version {v}: {err}")

    def _set_waiting(self, message: str | None) -> None:
        if message == self.waiting:
            return
        was, self.waiting = self.waiting, message
        if message is not None:
            log.warning("%s", message)
            runlog.append(self._events, {"event": "waiting", "step": self.engine.step_count, "message": message})
        elif was is not None:
            log.info("a replica serves the newest weights again; training goes on")
            runlog.append(self._events, {"event": "resumed", "step": self.engine.step_count})


def _error_text(err: BaseException) -> str:
    """A push failure in one line: a gRPC error's code and details (not its debug string)."""
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}"


def tls_names(addrs: list[str]) -> dict[str, str]:
    """Expanded target -> the host name it was resolved from (for TLS name checks)."""
    return {t: a.rpartition(":")[0].strip("[]") for a in addrs for t in expand_targets([a]) if t != a}


def expand_targets(addrs: list[str]) -> list[str]:
    """Every replica behind each ``host:port``: a compose service name or a Kubernetes headless Service resolves to
    one address per replica, and each must get the weights (one gRPC connection would reach only one of them).
    Resolved before every push, since replicas come and go."""
    out: list[str] = []
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError):
            out.append(addr)  # unresolvable now: try as given, the push reports the failure
            continue
        for ip in dict.fromkeys(info[4][0] for info in infos):
            target = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            if target not in out:
                out.append(target)
    return out
