from rlhf.v1 import common_pb2 as _common_pb2
from rlhf.v1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "adapter_safetensors", "adapter_config_json", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_safetensors: bytes
    adapter_config_json: str
    sha256: str
    def __init__(self, name: _Optional[str] = ..., adapter_safetensors: _Optional[bytes] = ..., adapter_config_json: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("name", "held", "policy_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    held: _containers.RepeatedScalarFieldContainer[str]
    policy_version: int
    def __init__(self, name: _Optional[str] = ..., held: _Optional[_Iterable[str]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "params", "request_id", "adapter", "raw_logprobs", "prompt_logprobs")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RAW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Prompt]
    params: _common_pb2.SamplingParams
    request_id: str
    adapter: str
    raw_logprobs: bool
    prompt_logprobs: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[_common_pb2.Prompt, _Mapping]]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., adapter: _Optional[str] = ..., raw_logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "text", "policy_version", "span_starts", "span_versions")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPAN_STARTS_FIELD_NUMBER: _ClassVar[int]
    SPAN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    text: str
    policy_version: int
    span_starts: _containers.RepeatedScalarFieldContainer[int]
    span_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., text: _Optional[str] = ..., policy_version: _Optional[int] = ..., span_starts: _Optional[_Iterable[int]] = ..., span_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptResult(_message.Message):
    __slots__ = ("prompt_token_ids", "completions", "prompt_logprobs")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "results", "policy_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    results: _containers.RepeatedCompositeFieldContainer[PromptResult]
    policy_version: int
    def __init__(self, request_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[PromptResult, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...
