"""Weight-sync refusals. Each subclasses an ``rlhf.serving.errors`` class, so the serving layer's one table
(``ERROR_TABLE``, looked up along the MRO) gives its gRPC code and HTTP status; there is no second table here.

Each class's docstring says when it is raised; the list with codes and statuses: docs/weight-sync.md#the-package.
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
