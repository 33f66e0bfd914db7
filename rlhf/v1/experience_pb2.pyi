from rlhf.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_TYPE_UNSPECIFIED: _ClassVar[RecordType]
    RECORD_TYPE_PROMPT_JOB: _ClassVar[RecordType]
    RECORD_TYPE_EXPERIENCE: _ClassVar[RecordType]
RECORD_TYPE_UNSPECIFIED: RecordType
RECORD_TYPE_PROMPT_JOB: RecordType
RECORD_TYPE_EXPERIENCE: RecordType

class PromptJob(_message.Message):
    __slots__ = ("job_id", "run_id", "data_index", "epoch", "prompt_ids", "prompt_text", "label", "params", "issued_policy_version", "issued_at_unix_ms", "metadata", "record_type")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RECORD_TYPE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    run_id: str
    data_index: int
    epoch: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    label: str
    params: _common_pb2.SamplingParams
    issued_policy_version: int
    issued_at_unix_ms: int
    metadata: _containers.ScalarMap[str, str]
    record_type: RecordType
    def __init__(self, job_id: _Optional[str] = ..., run_id: _Optional[str] = ..., data_index: _Optional[int] = ..., epoch: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., label: _Optional[str] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., issued_policy_version: _Optional[int] = ..., issued_at_unix_ms: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., record_type: _Optional[_Union[RecordType, str]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("response_ids", "sampling_logprobs", "ref_logprobs", "score", "score_status", "score_error", "score_components", "finish_reason", "policy_version", "response_text", "loss_mask", "turn_policy_versions", "turn_rewards", "ended_by", "episode_metrics", "span_starts", "span_versions")
    class ScoreComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class EpisodeMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORE_STATUS_FIELD_NUMBER: _ClassVar[int]
    SCORE_ERROR_FIELD_NUMBER: _ClassVar[int]
    SCORE_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURN_POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    ENDED_BY_FIELD_NUMBER: _ClassVar[int]
    EPISODE_METRICS_FIELD_NUMBER: _ClassVar[int]
    SPAN_STARTS_FIELD_NUMBER: _ClassVar[int]
    SPAN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ref_logprobs: _containers.RepeatedScalarFieldContainer[float]
    score: float
    score_status: _common_pb2.ItemStatus
    score_error: str
    score_components: _containers.ScalarMap[str, float]
    finish_reason: _common_pb2.FinishReason
    policy_version: int
    response_text: str
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    turn_policy_versions: _containers.RepeatedScalarFieldContainer[int]
    turn_rewards: _containers.RepeatedScalarFieldContainer[float]
    ended_by: str
    episode_metrics: _containers.ScalarMap[str, float]
    span_starts: _containers.RepeatedScalarFieldContainer[int]
    span_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, response_ids: _Optional[_Iterable[int]] = ..., sampling_logprobs: _Optional[_Iterable[float]] = ..., ref_logprobs: _Optional[_Iterable[float]] = ..., score: _Optional[float] = ..., score_status: _Optional[_Union[_common_pb2.ItemStatus, str]] = ..., score_error: _Optional[str] = ..., score_components: _Optional[_Mapping[str, float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ..., response_text: _Optional[str] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., turn_policy_versions: _Optional[_Iterable[int]] = ..., turn_rewards: _Optional[_Iterable[float]] = ..., ended_by: _Optional[str] = ..., episode_metrics: _Optional[_Mapping[str, float]] = ..., span_starts: _Optional[_Iterable[int]] = ..., span_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class Experience(_message.Message):
    __slots__ = ("job_id", "run_id", "data_index", "epoch", "prompt_ids", "prompt_text", "label", "samples", "replica_id", "created_at_unix_ms", "issued_policy_version", "record_type")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECORD_TYPE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    run_id: str
    data_index: int
    epoch: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    label: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    replica_id: str
    created_at_unix_ms: int
    issued_policy_version: int
    record_type: RecordType
    def __init__(self, job_id: _Optional[str] = ..., run_id: _Optional[str] = ..., data_index: _Optional[int] = ..., epoch: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., label: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., replica_id: _Optional[str] = ..., created_at_unix_ms: _Optional[int] = ..., issued_policy_version: _Optional[int] = ..., record_type: _Optional[_Union[RecordType, str]] = ...) -> None: ...
