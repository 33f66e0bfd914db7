"""The environment service's state: open episodes, episode id -> one :class:`Environment` instance.

Environment code is the user's and may block: every call runs in a worker thread, bounded by ``timeout_s``. Episodes
live in this process only, expire after ``episode_ttl_s`` without a call and number at most ``max_episodes``; a
repeated Reset or Step answers again instead of stepping twice; an environment that fails ends its episode.
Design: docs/services.md#environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from rlhf.config import ConfigError, ExperimentConfig
from rlhf.environments import registry
from rlhf.environments.base import Environment, EnvironmentFailure, EpisodeInputInvalid, Message, Opening, Outcome
from rlhf.environments.wire import message_to_proto
from rlhf.serving import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    NotReady,
    ResourceExhausted,
    ServiceMetrics,
)
from rlhf.serving.metrics import LATENCY_BUCKETS

log = logging.getLogger("rlhf.environment")

MAX_EPISODE_ID_CHARS = 512
MAX_TEXT_CHARS = 1_000_000
MAX_PROMPT_MESSAGES = 1024
MAX_INFO_ENTRIES = 256
WORKERS = 64  # threads running environment code; a hung call holds one until it returns


class EnvironmentFailed(Internal):
    """The environment's own code raised, or returned something that is not an opening / outcome: the episode is
    over and its sample is an error."""


class EnvironmentTimedOut(DeadlineExceeded):
    """The environment did not answer within ``environment.timeout_s``: the episode is over."""


@dataclass
class Episode:
    id: str
    environment: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    env: Environment | None = None
    opening: Opening | None = None
    turns: int = 0
    last: Outcome | None = None
    done: bool = False
    last_used: float = 0.0


class EnvironmentMetrics:
    """The service's own series, beside :class:`ServiceMetrics`'s request metrics, in the same registry."""

    def __init__(self, metrics: ServiceMetrics):
        r, self.service = metrics.registry, metrics.name
        self.episodes = Counter(
            "rlhf_env_episodes",
            "episodes by event: started, finished (done), failed (raised, unusable answer, timeout), expired (TTL)",
            ["service", "environment", "event"],
            registry=r,
        )
        self.steps = Counter("rlhf_env_steps", "steps made", ["service", "environment"], registry=r)
        self.step_seconds = Histogram(
            "rlhf_env_step_seconds",
            "seconds of one environment step",
            ["service", "environment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_metrics = Counter(
            "rlhf_env_step_metric",
            "sums of the counters environments report per step (tool_calls, tool_errors, ...)",
            ["service", "environment", "name"],
            registry=r,
        )
        self.open = Gauge("rlhf_env_open_episodes", "episodes open now", ["service"], registry=r)

    def event(self, env: str, event: str) -> None:
        self.episodes.labels(self.service, env, event).inc()

    def step(self, env: str, seconds: float, values: dict[str, float]) -> None:
        self.steps.labels(self.service, env).inc()
        self.step_seconds.labels(self.service, env).observe(seconds)
        for name, v in values.items():
            if v > 0:  # counters only go up; a negative value is not a count
                self.step_metrics.labels(self.service, env, name).inc(v)


def _check_text(value: str, name: str) -> None:
    if len(value) > MAX_TEXT_CHARS:
        raise InvalidArgument(f"{name} is {len(value)} characters; the limit is {MAX_TEXT_CHARS}", name)


def _check_episode_id(episode_id: str) -> None:
    if not episode_id:
        raise InvalidArgument("episode_id is empty: name the episode (e.g. <job_id>/<sample>/<attempt>)", "episode_id")
    if len(episode_id) > MAX_EPISODE_ID_CHARS:
        raise InvalidArgument(f"episode_id is over {MAX_EPISODE_ID_CHARS} characters", "episode_id")


def _check_messages(messages: Any, what: str) -> list[Message]:
    """An environment's messages as the wire carries them; EnvironmentFailed otherwise."""
    if not isinstance(messages, list):
        raise EnvironmentFailed(f"{what}: messages must be a list of dicts, not {type(messages).__name__}")
    for i, m in enumerate(messages):
        try:
            message_to_proto(m)
        except (TypeError, ValueError) as err:
            raise EnvironmentFailed(f"{what}: messages[{i}] is not a chat message ({err})") from None
    return messages


def _str_map(values: Any, what: str) -> dict[str, str]:
    if not isinstance(values, dict):
        raise EnvironmentFailed(f"{what} must be a dict, not {type(values).__name__}")
    return {str(k): str(v) for k, v in values.items()}


def _float_map(values: Any, what: str) -> dict[str, float]:
    if not isinstance(values, dict):
        raise EnvironmentFailed(f"{what} must be a dict, not {type(values).__name__}")
    try:
        out = {str(k): float(v) for k, v in values.items()}
    except (TypeError, ValueError) as err:
        raise EnvironmentFailed(f"{what} holds a value that is not a number ({err})") from None
    return out


class EnvironmentEngine:
    """Episodes of the hosted environments. ``hosted``: spec -> factory options (``{"builtin:calculator": {}}``)."""

    def __init__(
        self,
        hosted: dict[str, dict[str, Any]],
        *,
        timeout_s: float = 30.0,
        episode_ttl_s: float = 600.0,
        max_episodes: int = 4096,
        metrics: ServiceMetrics | None = None,
        workers: int = WORKERS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not hosted:
            raise ConfigError("environment.name is not set: the environment service needs an environment to host")
        self.factories: dict[str, Callable[..., Environment]] = {}
        self.options = {name: dict(opts) for name, opts in hosted.items()}
        for name, opts in self.options.items():
            try:
                factory = registry.resolve(name)
                registry.check_options(name, factory, opts)
            except registry.UnknownEnvironment as err:
                key = "environment.options" if str(err).startswith("options ") else "environment.name"
                raise ConfigError(f"{key}: {err}") from None
            self.factories[name] = factory
        self.timeout_s = timeout_s
        self.episode_ttl_s = episode_ttl_s
        self.max_episodes = max_episodes
        self.metrics = metrics or ServiceMetrics("environment")
        self.env_metrics = EnvironmentMetrics(self.metrics)
        self.clock = clock
        self.episodes: dict[str, Episode] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="environment")
        self._sweeper: asyncio.Task | None = None
        self._closing: set[asyncio.Future] = set()
        self.ready = False

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, metrics: ServiceMetrics | None = None, **kw: Any) -> EnvironmentEngine:
        """The engine of ``cfg.environment`` (``kw``: ``workers``, ``clock``)."""
        e = cfg.environment
        hosted = {e.name: e.options} if e.name else {}
        return cls(
            hosted,
            timeout_s=e.timeout_s,
            episode_ttl_s=e.episode_ttl_s,
            max_episodes=e.max_episodes,
            metrics=metrics,
            **kw,
        )

    # -- life cycle

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="environment-sweeper")
        self.ready = True

    async def close(self) -> None:
        self.ready = False
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(BaseException):
                await self._sweeper
        for ep in list(self.episodes.values()):
            self._forget(ep)
            if ep.env is not None:
                self._close_env(ep.environment, ep.env)
        if self._closing:  # close hooks get their timeout, not forever
            await asyncio.wait(set(self._closing), timeout=self.timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict[str, Any]:
        return {"environments": sorted(self.factories), "open_episodes": len(self.episodes)}

    # -- running environment code

    async def _run(self, ep: Episode, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread within ``timeout_s``. A raise, a timeout or a cancelled call ends the
        episode: its instance is closed when the call returns (a thread cannot be stopped from outside). The
        environment refusing the caller's input (:class:`EpisodeInputInvalid`) is the caller's error, 400 /
        INVALID_ARGUMENT naming the field, and not counted as the environment failing."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, functools.partial(fn, *args))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except BaseException as err:
            refused = isinstance(err, EpisodeInputInvalid)
            self._end_failed(ep, fut, made=what == "make", event=None if refused else "failed")
            if refused:
                raise InvalidArgument(f"{ep.environment} {what}: {err}", err.field) from None
            if isinstance(err, TimeoutError):
                raise EnvironmentTimedOut(
                    f"{ep.environment} {what} of episode {ep.id!r} took over {self.timeout_s:g}s "
                    "(environment.timeout_s); the episode is over"
                ) from None
            if isinstance(err, EnvironmentFailure):
                raise EnvironmentFailed(f"{ep.environment} {what} failed: {err}") from None
            if isinstance(err, Exception):
                log.warning("%s %s of episode %r raised", ep.environment, what, ep.id, exc_info=err)
                raise EnvironmentFailed(f"{ep.environment} {what} raised {type(err).__name__}: {err}") from None
            raise  # cancelled: the caller went away

    def _end_failed(self, ep: Episode, fut: asyncio.Future, made: bool = False, event: str | None = "failed") -> None:
        """Drop the episode (counted as ``event``, if any); close its instance once the call in flight returns
        (``made``: the call is the factory, whose late result is the instance)."""
        if self.episodes.get(ep.id) is ep:
            self._forget(ep)
            if event is not None:
                self.env_metrics.event(ep.environment, event)

        def close_after(f: asyncio.Future) -> None:
            env = ep.env
            if made and not f.cancelled() and f.exception() is None:
                env = f.result()
            if isinstance(env, Environment):
                self._close_env(ep.environment, env)

        fut.add_done_callback(close_after)

    def _forget(self, ep: Episode) -> None:
        if self.episodes.get(ep.id) is ep:
            del self.episodes[ep.id]
            self.env_metrics.open.labels(self.env_metrics.service).set(len(self.episodes))

    def _close_env(self, name: str, env: Environment) -> None:
        """Run the instance's close hook in a worker thread; a failure there is logged only (the episode is over)."""

        def close() -> None:
            try:
                env.close()
            except Exception:  # nothing the caller can do about it
                log.warning("%s: close raised", name, exc_info=True)

        try:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, close)
        except RuntimeError:  # the pool is shut down (service stopping)
            return
        self._closing.add(fut)
        fut.add_done_callback(self._closing.discard)

    # -- episodes

    def _name(self, environment: str) -> str:
        if not environment:
            if len(self.factories) == 1:
                return next(iter(self.factories))
            raise InvalidArgument(
                f"environment is empty and this service hosts {len(self.factories)}: name one of "
                f"{', '.join(sorted(self.factories))}",
                "environment",
            )
        if environment not in self.factories:
            raise InvalidArgument(
                f"environment {environment!r} is not hosted by this service (it hosts "
                f"{', '.join(sorted(self.factories))})",
                "environment",
            )
        return environment

    def _check_ready(self) -> None:
        if not self.ready:
            raise NotReady("the environment service is starting or stopping; retry when /readyz answers 200")

    def _sweep(self) -> None:
        """Close the episodes idle for ``episode_ttl_s`` (not those with a call in progress)."""
        cutoff = self.clock() - self.episode_ttl_s
        for ep in [e for e in self.episodes.values() if e.last_used < cutoff and not e.lock.locked()]:
            self._forget(ep)
            self.env_metrics.event(ep.environment, "expired")
            if ep.env is not None:
                self._close_env(ep.environment, ep.env)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(max(self.episode_ttl_s / 4, 0.05), 30.0))
            self._sweep()

    async def reset(
        self,
        episode_id: str,
        environment: str,
        prompt: list[Message],
        label: str | None,
        info: dict[str, str],
        seed: int | None,
    ) -> Opening:
        self._check_ready()
        _check_episode_id(episode_id)
        name = self._name(environment)
        if len(prompt) > MAX_PROMPT_MESSAGES:
            raise InvalidArgument(f"prompt has {len(prompt)} messages; at most {MAX_PROMPT_MESSAGES}", "prompt")
        for i, m in enumerate(prompt):
            _check_text(m.get("content") if isinstance(m.get("content"), str) else "", f"prompt[{i}].content")
        if label is not None:
            _check_text(label, "label")
        if len(info) > MAX_INFO_ENTRIES:
            raise InvalidArgument(f"info has {len(info)} entries; at most {MAX_INFO_ENTRIES}", "info")
        while True:
            ep = self.episodes.get(episode_id)
            if ep is None:
                break
            if ep.environment != name:
                raise FailedPrecondition(
                    f"episode {episode_id!r} is an episode of {ep.environment}, not {name}: use a new episode id",
                    "episode_id",
                )
            async with ep.lock:  # a reset still in progress (the original call of this retry) finishes first
                if self.episodes.get(episode_id) is not ep:
                    continue  # it failed and was dropped: start afresh
                if ep.turns:
                    raise FailedPrecondition(
                        f"episode {episode_id!r} has made {ep.turns} steps already: a new attempt needs a new "
                        "episode id",
                        "episode_id",
                    )
                ep.last_used = self.clock()
                assert ep.opening is not None
                return ep.opening
        self._sweep()
        if len(self.episodes) >= self.max_episodes:
            raise ResourceExhausted(
                f"{len(self.episodes)} episodes are open, the limit (environment.max_episodes); close finished "
                "episodes, or retry later"
            )
        ep = Episode(episode_id, name, last_used=self.clock())
        async with ep.lock:
            self.episodes[episode_id] = ep
            self.env_metrics.open.labels(self.env_metrics.service).set(len(self.episodes))
            factory, options = self.factories[name], self.options[name]
            ep.env = await self._run(ep, "make", functools.partial(factory, **options))
            if not isinstance(ep.env, Environment):
                got, ep.env = type(ep.env).__name__, None
                self._forget(ep)
                self.env_metrics.event(name, "failed")
                raise EnvironmentFailed(f"{name} made a {got}, not an rlhf.environments.base.Environment")
            opening = await self._run(ep, "reset", ep.env.reset, list(prompt), label, dict(info), seed)
            try:
                if not isinstance(opening, Opening):
                    raise EnvironmentFailed(f"{name} reset returned a {type(opening).__name__}, not an Opening")
                _check_messages(opening.messages, f"{name} reset")
                if not isinstance(opening.tools, list) or not all(isinstance(t, dict) for t in opening.tools):
                    raise EnvironmentFailed(f"{name} reset: tools must be a list of dicts")
                opening.info = _str_map(opening.info, f"{name} reset: info")
            except EnvironmentFailed:
                self._forget(ep)
                self.env_metrics.event(name, "failed")
                self._close_env(name, ep.env)
                raise
            ep.opening = opening
            ep.last_used = self.clock()
        self.env_metrics.event(name, "started")
        return opening

    def _episode(self, episode_id: str) -> Episode:
        ep = self.episodes.get(episode_id)
        if ep is None:
            raise NotFound(
                f"episode {episode_id!r} is not open here (never reset, closed, failed, idle over "
                f"{self.episode_ttl_s:g}s, or the service restarted): start the episode again",
                "episode_id",
            )
        return ep

    async def step(self, episode_id: str, action: str, turn: int | None = None) -> Outcome:
        self._check_ready()
        _check_episode_id(episode_id)
        _check_text(action, "action")
        if turn is not None and turn < 0:
            raise InvalidArgument(f"turn is {turn}: count the steps made before this one (>= 0)", "turn")
        ep = self._episode(episode_id)
        async with ep.lock:
            ep = self._episode(episode_id)  # it may have failed or closed while this call waited
            if turn is not None and turn != ep.turns:
                if turn == ep.turns - 1 and ep.last is not None:
                    ep.last_used = self.clock()
                    return ep.last  # a retry of the last step: the same answer, not a second step
                raise FailedPrecondition(
                    f"turn {turn} does not follow the {ep.turns} steps episode {episode_id!r} has made", "turn"
                )
            if ep.done:
                raise FailedPrecondition(f"episode {episode_id!r} is done: close it", "episode_id")
            assert ep.env is not None
            t0 = time.perf_counter()
            outcome = await self._run(ep, "step", ep.env.step, action)
            seconds = time.perf_counter() - t0
            name = ep.environment
            try:
                if not isinstance(outcome, Outcome):
                    raise EnvironmentFailed(f"{name} step returned a {type(outcome).__name__}, not an Outcome")
                _check_messages(outcome.messages, f"{name} step")
                try:
                    outcome.reward = float(outcome.reward)
                except (TypeError, ValueError):
                    raise EnvironmentFailed(f"{name} step: reward {outcome.reward!r} is not a number") from None
                if not math.isfinite(outcome.reward):
                    raise EnvironmentFailed(f"{name} step: reward {outcome.reward} is not finite")
                outcome.done = bool(outcome.done)
                outcome.info = _str_map(outcome.info, f"{name} step: info")
                outcome.metrics = _float_map(outcome.metrics, f"{name} step: metrics")
            except EnvironmentFailed:
                self._forget(ep)
                self.env_metrics.event(name, "failed")
                self._close_env(name, ep.env)
                raise
            ep.turns += 1
            ep.last, ep.done, ep.last_used = outcome, outcome.done, self.clock()
            self.env_metrics.step(name, seconds, outcome.metrics)
            if outcome.done:
                self.env_metrics.event(name, "finished")
            return outcome

    async def close_episode(self, episode_id: str) -> bool:
        """Forget the episode and run its close hook; False when it was not open (closing twice is fine)."""
        self._check_ready()
        _check_episode_id(episode_id)
        ep = self.episodes.get(episode_id)
        if ep is None:
            return False
        self._forget(ep)  # new calls now get NOT_FOUND; one in progress finishes first
        async with ep.lock:
            if ep.env is not None:
                self._close_env(ep.environment, ep.env)
        return True
