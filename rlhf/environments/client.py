"""The environment service's client (what a rollout replica uses)::

    async with EnvironmentClient("127.0.0.1:50060", token, timeout_s=30) as env:
        opening = await env.reset("job-1/0/0", "builtin:calculator", [{"role": "user", "content": q}], label="5")
        outcome = await env.step("job-1/0/0", model_text)       # until outcome.done
        await env.close("job-1/0/0")

Failures are :class:`EnvironmentCallError` with a ``kind`` saying what to do (``episode_lost``, ``timeout``,
``failed``, ``unavailable``, ``invalid``); retries are safe. Design: docs/services.md#environment.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc

from rlhf.environments.base import EnvironmentFailure, Message, Opening, Outcome
from rlhf.environments.wire import message_from_proto, message_to_proto
from rlhf.retry import retry
from rlhf.serving.auth import grpc_auth_metadata
from rlhf.serving.runner import client_credentials, grpc_options
from rlhf.serving.settings import ServiceSettings
from rlhf.v1 import environment_pb2, environment_pb2_grpc

log = logging.getLogger("rlhf.environments")


class EnvironmentCallError(EnvironmentFailure):
    """A failed call to the environment service; ``kind`` says what to do (module docstring), ``code`` is the gRPC
    status code's name, ``field`` the request field the service blamed (``label``), if any."""

    kind = "failed"

    def __init__(self, message: str, code: str = "", episode_id: str = "", field: str = ""):
        super().__init__(message)
        self.code = code
        self.episode_id = episode_id
        self.field = field


class EpisodeLost(EnvironmentCallError):
    """The service does not know the episode (restarted, expired, closed, failed): start it again."""

    kind = "episode_lost"


class EnvironmentTimeout(EnvironmentCallError):
    kind = "timeout"


class EnvironmentFailed(EnvironmentCallError):
    kind = "failed"


class EnvironmentUnavailable(EnvironmentCallError):
    kind = "unavailable"


class EnvironmentRequestInvalid(EnvironmentCallError):
    kind = "invalid"


_BY_CODE: dict[grpc.StatusCode, type[EnvironmentCallError]] = {
    grpc.StatusCode.NOT_FOUND: EpisodeLost,
    grpc.StatusCode.DEADLINE_EXCEEDED: EnvironmentTimeout,
    grpc.StatusCode.UNAVAILABLE: EnvironmentUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EnvironmentUnavailable,
    grpc.StatusCode.INVALID_ARGUMENT: EnvironmentRequestInvalid,
    grpc.StatusCode.UNAUTHENTICATED: EnvironmentRequestInvalid,
    grpc.StatusCode.PERMISSION_DENIED: EnvironmentRequestInvalid,
}


def _error(err: grpc.aio.AioRpcError, what: str, episode_id: str) -> EnvironmentCallError:
    code = err.code()
    cls = _BY_CODE.get(code, EnvironmentFailed)
    field = dict(err.trailing_metadata() or ()).get("rlhf-error-field", "")  # set by rlhf.serving.abort_grpc
    message = f"environment {what} of episode {episode_id!r}: {code.name}: {err.details()}"
    return cls(message, code.name, episode_id, field if isinstance(field, str) else "")


# gRPC's reconnect backoff grows to 120 s by default: a restarted environment service (whose episodes are lost, so
# the caller wants to hear NOT_FOUND soon) would then look unavailable long after it is back.
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]


def _channel(addr: str, settings: ServiceSettings | None) -> grpc.aio.Channel:
    """:func:`rlhf.serving.open_channel`'s channel (message sizes, keepalive, TLS per the settings) with a short
    reconnect backoff."""
    settings = settings or ServiceSettings()
    options = [*grpc_options(settings), *_RECONNECT]
    creds = client_credentials(settings)
    if creds is not None:
        return grpc.aio.secure_channel(addr, creds, options=options)
    return grpc.aio.insecure_channel(addr, options=options)


class EnvironmentClient:
    """Async client of one environment service. ``timeout_s``: the deadline of each call (make it a little more
    than the service's ``environment.timeout_s``, so the service's own timeout, which names the environment, comes
    first). ``settings``: TLS and message sizes as the calling service has them (default: plaintext)."""

    def __init__(
        self,
        addr: str,
        token: str | None,
        timeout_s: float = 30.0,
        *,
        retries: int = 3,
        backoff_s: float = 0.2,
        settings: ServiceSettings | None = None,
    ):
        self.addr = addr
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._metadata = grpc_auth_metadata(token)
        self._channel = _channel(addr, settings)
        self._stub = environment_pb2_grpc.EnvironmentServiceStub(self._channel)
        self._turns: dict[str, int] = {}  # episode id -> steps answered (the next step's turn)

    async def __aenter__(self) -> EnvironmentClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._channel.close()

    async def _call(self, what: str, method: Any, request: Any, episode_id: str) -> Any:
        try:
            return await retry(
                lambda: method(request, timeout=self.timeout_s, metadata=self._metadata, wait_for_ready=False),
                lambda err: isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE,
                what=f"environment {what} at {self.addr} failed",
                log=log,
                attempts=self.retries + 1,
                initial_s=self.backoff_s,
                level=logging.INFO,
            )
        except grpc.aio.AioRpcError as err:
            raise _error(err, what, episode_id) from None

    async def reset(
        self,
        episode_id: str,
        environment: str,
        prompt: list[Message],
        label: str | None = None,
        info: dict[str, str] | None = None,
        seed: int | None = None,
    ) -> Opening:
        """Start the episode (the same opening again when ``episode_id`` is already open and not stepped)."""
        req = environment_pb2.ResetRequest(
            episode_id=episode_id, environment=environment, prompt=[message_to_proto(m) for m in prompt]
        )
        if label is not None:
            req.label = label
        if seed is not None:
            req.seed = seed
        req.info.update(info or {})
        resp = await self._call("reset", self._stub.Reset, req, episode_id)
        self._turns[episode_id] = 0
        return Opening(
            messages=[message_from_proto(m) for m in resp.messages],
            tools=json.loads(resp.tools_json) if resp.tools_json else [],
            info=dict(resp.info),
        )

    async def step(self, episode_id: str, action: str) -> Outcome:
        """One model turn. The turn number sent is the count of steps this client had answered in the episode."""
        req = environment_pb2.StepRequest(episode_id=episode_id, action=action)
        turn = self._turns.get(episode_id)
        if turn is not None:
            req.turn = turn
        try:
            resp = await self._call("step", self._stub.Step, req, episode_id)
        except EnvironmentCallError as err:
            if err.kind != "unavailable":  # the episode is over server-side (or was never open); a retry keeps its turn
                self._turns.pop(episode_id, None)
            raise
        if turn is not None:
            self._turns[episode_id] = turn + 1
        return Outcome(
            messages=[message_from_proto(m) for m in resp.messages],
            reward=resp.reward,
            done=resp.done,
            info=dict(resp.info),
            metrics=dict(resp.metrics),
        )

    async def close(self, episode_id: str) -> bool:
        """Release the episode; False when the service did not have it open (not an error)."""
        self._turns.pop(episode_id, None)
        resp = await self._call(
            "close", self._stub.Close, environment_pb2.CloseRequest(episode_id=episode_id), episode_id
        )
        return resp.existed
