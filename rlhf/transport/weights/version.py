"""The served weights version: one owner per replica, one rule for "newer".

:class:`ServedVersion` is the only place a replica keeps the version it serves (with the update's parent version,
checksum and load time); :func:`check_newer` is the one check every path uses: ``0 <= parent_version < version``
and ``version > served``. A continuation (``parent_version == served``) and a jump are both accepted, and
:meth:`ServedVersion.advance` records which it was. This module imports no torch.

Design: docs/weight-sync.md#versions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlhf.transport.weights.errors import CorruptUpdate, StaleVersion

INITIAL_CHECKSUM = "initial"


def check_newer(version: int, parent_version: int, served: int) -> bool:
    """Raise unless ``(version, parent_version)`` may replace ``served``; returns True for a continuation
    (``parent_version == served``), False for a jump over missed versions."""
    if version <= served:
        raise StaleVersion(
            f"weights version {version} is not newer than the served version {served}: versions never go "
            "backwards; publish under a higher version",
            field="header.version",
        )
    if not 0 <= parent_version < version:
        raise CorruptUpdate(
            f"parent_version {parent_version} must be at least 0 and smaller than version {version}",
            field="header.parent_version",
        )
    return parent_version == served


@dataclass
class ServedVersion:
    """What a replica serves now. Only :meth:`advance` changes it, and only forwards."""

    version: int = 0
    parent_version: int = 0
    checksum: str = INITIAL_CHECKSUM
    loaded_at_unix_ms: int = 0
    jumps: int = 0  # updates accepted whose parent was not the served version (missed pushes, restores)

    def check(self, version: int, parent_version: int) -> bool:
        """:func:`check_newer` against what serves now."""
        return check_newer(version, parent_version, self.version)

    def advance(self, version: int, parent_version: int, checksum: str) -> None:
        """Record that ``version`` serves now (call at the swap, under the engine's gate). Raises StaleVersion
        when another swap got there first with the same or a newer version."""
        continuation = self.check(version, parent_version)
        self.version, self.parent_version, self.checksum = version, parent_version, checksum
        self.loaded_at_unix_ms = int(time.time() * 1000)
        self.jumps += 0 if continuation else 1

    def mark_loaded(self) -> None:
        """The initial weights finished loading (version unchanged)."""
        self.loaded_at_unix_ms = int(time.time() * 1000)
