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
