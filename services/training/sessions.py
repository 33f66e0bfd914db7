"""The training service's sessions: :class:`Sessions`, one per SDK ``ServiceClient``, each owned by the user (token)
that created it and kept alive by heartbeats; another user gets 404 for it, as for one that does not exist. What a
session holds (runs, samplers) is named after it (``<session>:train:<n>``, ``<session>:sample:<n>``) and unloaded by
the engine when it ends or expires. Design: docs/tinker.md.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field

from rlhf.serving import NotFound

# A session without a heartbeat for this long has its runs unloaded (the SDK heartbeats every 10 s).
SESSION_TTL_S = 600.0


@dataclass
class Session:
    owner: str
    created: float
    last_heartbeat: float
    finished: str | None = None
    meta: dict = field(default_factory=dict)


def owner_of(token: str) -> str:
    """A user's id: a digest of the token (the token itself is never stored or written)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def session_of(name: str) -> str:
    """The session a run's or a sampler's id is named after."""
    return name.split(":", 1)[0]


class Sessions:
    """Every session of this process by id; ``ttl_s``: how long one lives without a heartbeat."""

    def __init__(self, ttl_s: float = SESSION_TTL_S):
        self.ttl_s = ttl_s
        self.by_id: dict[str, Session] = {}

    def create(self, owner: str, meta: dict) -> str:
        session_id = uuid.uuid4().hex
        now = time.monotonic()
        self.by_id[session_id] = Session(owner, now, now, meta=meta)
        return session_id

    def get(self, owner: str, session_id: str, live: bool = True) -> Session:
        s = self.by_id.get(session_id)
        if s is None or s.owner != owner:
            raise NotFound(f"session {session_id!r} does not exist (or is not yours)", field="session_id")
        if live and s.finished is not None:
            raise NotFound(
                f"session {session_id!r} is over ({s.finished}): start a new ServiceClient", field="session_id"
            )
        return s

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.get(owner, session_id).last_heartbeat = time.monotonic()

    def finish(self, owner: str, session_id: str, reason: str) -> bool:
        """Mark the session finished; True the first time (the first reason wins, as the SDK documents)."""
        s = self.get(owner, session_id, live=False)
        if s.finished is not None:
            return False
        s.finished = reason
        return True

    def expire(self, now: float) -> list[str]:
        """Mark finished (``expired``) the live sessions whose last heartbeat is over ``ttl_s`` before ``now``
        (monotonic); returns their ids."""
        stale = [sid for sid, s in self.by_id.items() if s.finished is None and now - s.last_heartbeat > self.ttl_s]
        for sid in stale:
            self.by_id[sid].finished = "expired"
        return stale

    def owner(self, session_id: str) -> str | None:
        s = self.by_id.get(session_id)
        return None if s is None else s.owner
