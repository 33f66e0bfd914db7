"""The training service's futures: :class:`FutureBook` queues each model operation on the ONE worker thread in the
order the requests arrived, numbers it (a request id that carries this process's boot id), recognises the SDK's
resends by ``seq_id``, and answers ``retrieve_future`` with an :class:`Outcome`.

Futures are in memory: a future of an earlier process (the service restarted while it was queued, running or
unretrieved) is answered with an error, never a result. Design: docs/tinker.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rlhf.serving import InvalidArgument, NotFound, RLHFError
from rlhf.serving.errors import status_for

log = logging.getLogger("rlhf.training")

# Seconds retrieve_future waits for a running request before answering try_again: the SDK polls again at once after a
# try_again, so the server holds the poll (its read timeout is 45 s).
LONG_POLL_S = 20.0
KEEP_FUTURES = 4096  # finished futures kept for retrieval (oldest dropped first)

Job = Callable[[], dict[str, Any]]  # a model operation, run on the worker thread; its result is the future's


class RequestFailed(Exception):
    """A queued request that failed: the future answers ``{"error": message, "category": category}``."""

    def __init__(self, message: str, category: str = "user"):
        super().__init__(message)
        self.message = message
        self.category = category


@dataclass(frozen=True)
class Outcome:
    """What ``retrieve_future`` answers: still running, the job's result, or an error and whose fault it is
    (``user``: the request; ``server``: this service)."""

    state: Literal["pending", "done", "failed"]
    result: dict[str, Any] | None = None
    error: str = ""
    category: str = ""


@dataclass
class _Future:
    owner: str
    kind: str
    future: concurrent.futures.Future


def failure(err: BaseException) -> tuple[str, str] | None:
    """(message, category) of a job's error the client caused or can act on; None for an internal one. The
    category of an rlhf.serving error follows its HTTP status in the one error table (4xx: the user's)."""
    if isinstance(err, RequestFailed):
        return err.message, err.category
    if isinstance(err, ValueError) or (isinstance(err, RLHFError) and status_for(err)[1] < 500):
        return str(err), "user"
    return None


class FutureBook:
    """The futures of one process, run on ``worker`` (one thread) and known by ids that start with ``boot``."""

    def __init__(self, worker: concurrent.futures.ThreadPoolExecutor, boot: str):
        self.worker = worker
        self.boot = boot
        self._lock = threading.Lock()
        self._futures: OrderedDict[str, _Future] = OrderedDict()
        self._counter = 0
        self._seq: dict[str, tuple[int, str]] = {}  # model id -> (last seq_id, its request id)
        self.created: dict[str, str] = {}  # model id -> the request id that creates it
        self._sample_seq: dict[tuple[str, int], tuple[str, list[str]]] = {}  # (sampler, seq_id) -> its future

    def submit(self, owner: str, kind: str, job: Job, executor: concurrent.futures.Executor | None = None) -> str:
        """``job`` on the worker thread, or on ``executor`` (the fleet's calls, which wait on a replica)."""
        with self._lock:
            self._counter += 1
            request_id = f"{self.boot}-{self._counter}"
        entry = _Future(owner, kind, (executor or self.worker).submit(job))
        with self._lock:
            self._futures[request_id] = entry
            self._trim()
        return request_id

    def retry_of(self, model_id: str, seq_id: int | None) -> str | None:
        """The SDK numbers a training client's requests (seq_id 1, 2, ...) and resends one whose answer it lost: the
        request id of an accepted seq_id again (a resend, not a second step), None for a new one. Going backwards is
        refused: the requests of a model run in the order they are numbered."""
        if not seq_id:
            return None
        last = self._seq.get(model_id)
        if last is None or seq_id > last[0]:
            return None
        if seq_id == last[0]:
            return last[1]
        raise InvalidArgument(
            f"seq_id {seq_id} comes after seq_id {last[0]} for model {model_id}: a training client's requests are "
            "numbered in the order they are sent",
            field="seq_id",
        )

    def submit_seq(self, owner: str, model_id: str, seq_id: int | None, kind: str, job: Job) -> str:
        request_id = self.submit(owner, kind, job)
        if seq_id:
            self._seq[model_id] = (seq_id, request_id)
        return request_id

    def forget(self, model_id: str) -> None:
        """A run that was unloaded: its numbering starts again if a client resumes it under the same id."""
        self._seq.pop(model_id, None)

    def sample_of(self, sampler_id: str, seq_id: int | None) -> tuple[str, list[str]] | None:
        """The future of a sample request already accepted under ``seq_id`` (a resend), else None."""
        return None if seq_id is None else self._sample_seq.get((sampler_id, seq_id))

    def remember_sample(self, sampler_id: str, seq_id: int | None, out: tuple[str, list[str]]) -> None:
        if seq_id is None:
            return
        with self._lock:
            self._sample_seq[(sampler_id, seq_id)] = out
            while len(self._sample_seq) > KEEP_FUTURES:
                del self._sample_seq[next(iter(self._sample_seq))]

    def _trim(self) -> None:
        finished = [k for k, v in self._futures.items() if v.future.done()]
        for key in finished[: max(0, len(finished) - KEEP_FUTURES)]:
            del self._futures[key]

    async def retrieve(self, owner: str, request_id: str) -> Outcome:
        boot, _, number = request_id.partition("-")
        if boot != self.boot and len(boot) == len(self.boot) and number.isdigit():
            message = (
                f"request {request_id} was accepted by an earlier run of the training service, which stopped before "
                "its result was retrieved; nothing of it is known now: reload your last checkpoint (load_state) and "
                "resend"
            )
            return Outcome("failed", error=message, category="server")
        entry = self._futures.get(request_id)
        if entry is None or entry.owner != owner:
            raise NotFound(f"request {request_id!r} is not known (or not yours)", field="request_id")
        if not entry.future.done():
            # any outcome (done, failed, still running) is read below
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(entry.future)), LONG_POLL_S)
        if not entry.future.done():
            return Outcome("pending")
        err = entry.future.exception()
        if err is None:
            return Outcome("done", result=entry.future.result())
        known = failure(err)
        if known is not None:
            return Outcome("failed", error=known[0], category=known[1])
        log.exception("training: request %s failed", request_id, exc_info=err)
        return Outcome("failed", error=f"internal error in {entry.kind}: {type(err).__name__}", category="server")
