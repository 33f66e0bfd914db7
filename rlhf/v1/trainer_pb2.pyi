from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueDepths(_message.Message):
    __slots__ = ("prompts_pending", "prompts_backlog", "experience_backlog", "dead_letters")
    PROMPTS_PENDING_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    EXPERIENCE_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    prompts_pending: int
    prompts_backlog: int
    experience_backlog: int
    dead_letters: int
    def __init__(self, prompts_pending: _Optional[int] = ..., prompts_backlog: _Optional[int] = ..., experience_backlog: _Optional[int] = ..., dead_letters: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "stage", "step", "policy_version", "paused", "queues", "mean_staleness", "max_staleness", "metrics", "samples_trained")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    stage: str
    step: int
    policy_version: int
    paused: bool
    queues: QueueDepths
    mean_staleness: float
    max_staleness: int
    metrics: _containers.ScalarMap[str, float]
    samples_trained: int
    def __init__(self, run_id: _Optional[str] = ..., stage: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., paused: _Optional[bool] = ..., queues: _Optional[_Union[QueueDepths, _Mapping]] = ..., mean_staleness: _Optional[float] = ..., max_staleness: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., samples_trained: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "policy_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    policy_version: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdminResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...
