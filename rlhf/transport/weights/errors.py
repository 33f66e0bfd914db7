"""Weight-sync refusals. Each subclasses an ``rlhf.serving.errors`` class, so the serving layer's one table
(``ERROR_TABLE``, looked up along the MRO) gives its gRPC code and HTTP status; there is no second table here.

=======================  ======================  ============================================================
error                    gRPC code (HTTP)        when
=======================  ======================  ============================================================
StaleVersion             FAILED_PRECONDITION     the version is not newer than the one served (409)
UpdateInProgress         FAILED_PRECONDITION     another update holds the replica's one update slot (409)
CorruptUpdate            INVALID_ARGUMENT        bad header, out-of-order chunk, size or sha256 mismatch (400)
IncompleteUpdate         INVALID_ARGUMENT        the data ended, was cut, timed out or was aborted (400)
IncompatibleUpdate       INVALID_ARGUMENT        the manifest does not fit the served model (400)
UpdateTooLarge           RESOURCE_EXHAUSTED      over the replica's byte limits (413)
CollectiveUnavailable    FAILED_PRECONDITION     the replica cannot run the push's collective backend (409)
DeltaBaseMissing         FAILED_PRECONDITION     a delta push's base is not the update this replica holds (409)
=======================  ======================  ============================================================
"""

from __future__ import annotations

from rlhf.serving.errors import FailedPrecondition, InvalidArgument, PayloadTooLarge, RLHFError


class WeightSyncError(RLHFError):
    """Base of every weight-sync refusal; the replica keeps serving its current weights. Never raised itself."""


class StaleVersion(WeightSyncError, FailedPrecondition):
    pass


class UpdateInProgress(WeightSyncError, FailedPrecondition):
    pass


class CorruptUpdate(WeightSyncError, InvalidArgument):
    pass


class IncompleteUpdate(WeightSyncError, InvalidArgument):
    pass


class IncompatibleUpdate(WeightSyncError, InvalidArgument):
    pass


class UpdateTooLarge(WeightSyncError, PayloadTooLarge):
    pass


class CollectiveUnavailable(WeightSyncError, FailedPrecondition):
    """A collective push asks for a backend this replica cannot run (nccl without CUDA, hccl without torch_npu)."""


class DeltaBaseMissing(WeightSyncError, FailedPrecondition):
    """A delta push names a base update this replica does not hold (a late joiner, a restart, a missed push, or an
    engine that takes the update as it arrives): the trainer sends the full update instead."""


# Refusals that say the update itself can never fit this replica (other tensors, or more bytes than it accepts): a
# trainer that retries them would push the same weights forever while the ring trains on nothing.
FINAL_REFUSALS = (IncompatibleUpdate, UpdateTooLarge)


def refusal_type(err: BaseException) -> str | None:
    """The name of the refusal class behind ``err``: raised here, or carried by a gRPC error's ``rlhf-error-type``
    trailing metadata (None when there is neither)."""
    if isinstance(err, WeightSyncError):
        return type(err).__name__
    trailing = getattr(err, "trailing_metadata", None)
    if not callable(trailing):
        return None
    try:
        return dict(trailing() or ()).get("rlhf-error-type")
    except Exception:  # noqa: BLE001 - a call that never reached the server has no metadata
        return None


def is_final_refusal(err: BaseException) -> bool:
    """``err`` (raised here, or a gRPC error carrying the replica's ``rlhf-error-type``) is a :data:`FINAL_REFUSALS`."""
    if isinstance(err, FINAL_REFUSALS):
        return True
    trailing = getattr(err, "trailing_metadata", None)
    if not callable(trailing):
        return False
    try:
        meta = dict(trailing() or ())
    except Exception:  # noqa: BLE001 - a call that never reached the server has no metadata
        return False
    return meta.get("rlhf-error-type") in {cls.__name__ for cls in FINAL_REFUSALS}
