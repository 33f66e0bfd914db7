from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogProbsItem(_message.Message):
    __slots__ = ("prompt_ids", "response_ids")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LogProbsRequest(_message.Message):
    __slots__ = ("items", "temperature")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[LogProbsItem]
    temperature: float
    def __init__(self, items: _Optional[_Iterable[_Union[LogProbsItem, _Mapping]]] = ..., temperature: _Optional[float] = ...) -> None: ...

class TokenLogProbs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LogProbsResponse(_message.Message):
    __slots__ = ("results", "temperature")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenLogProbs]
    temperature: float
    def __init__(self, results: _Optional[_Iterable[_Union[TokenLogProbs, _Mapping]]] = ..., temperature: _Optional[float] = ...) -> None: ...
