from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "bucket")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    bucket: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., bucket: _Optional[int] = ...) -> None: ...

class BucketEntry(_message.Message):
    __slots__ = ("index", "nbytes", "sha256", "device_digest", "encoding", "full_nbytes", "full_sha256")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    FULL_NBYTES_FIELD_NUMBER: _ClassVar[int]
    FULL_SHA256_FIELD_NUMBER: _ClassVar[int]
    index: int
    nbytes: int
    sha256: str
    device_digest: str
    encoding: str
    full_nbytes: int
    full_sha256: str
    def __init__(self, index: _Optional[int] = ..., nbytes: _Optional[int] = ..., sha256: _Optional[str] = ..., device_digest: _Optional[str] = ..., encoding: _Optional[str] = ..., full_nbytes: _Optional[int] = ..., full_sha256: _Optional[str] = ...) -> None: ...

class WeightHeader(_message.Message):
    __slots__ = ("version", "parent_version", "tensors", "buckets", "checksum", "format", "total_bytes", "delta_base_version", "delta_base_checksum", "keep_base")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    KEEP_BASE_FIELD_NUMBER: _ClassVar[int]
    version: int
    parent_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    buckets: _containers.RepeatedCompositeFieldContainer[BucketEntry]
    checksum: str
    format: str
    total_bytes: int
    delta_base_version: int
    delta_base_checksum: str
    keep_base: bool
    def __init__(self, version: _Optional[int] = ..., parent_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., buckets: _Optional[_Iterable[_Union[BucketEntry, _Mapping]]] = ..., checksum: _Optional[str] = ..., format: _Optional[str] = ..., total_bytes: _Optional[int] = ..., delta_base_version: _Optional[int] = ..., delta_base_checksum: _Optional[str] = ..., keep_base: _Optional[bool] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("bucket", "offset", "data")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    offset: int
    data: bytes
    def __init__(self, bucket: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightUpdate(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    chunk: WeightChunk
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., chunk: _Optional[_Union[WeightChunk, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "swapped", "bytes_received", "checksum", "stage_seconds", "swap_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    swapped: bool
    bytes_received: int
    checksum: str
    stage_seconds: float
    swap_seconds: float
    def __init__(self, version: _Optional[int] = ..., swapped: _Optional[bool] = ..., bytes_received: _Optional[int] = ..., checksum: _Optional[str] = ..., stage_seconds: _Optional[float] = ..., swap_seconds: _Optional[float] = ...) -> None: ...

class OpenWeightsTransferRequest(_message.Message):
    __slots__ = ("header", "group")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    group: CollectiveGroup
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., group: _Optional[_Union[CollectiveGroup, _Mapping]] = ...) -> None: ...

class CollectiveGroup(_message.Message):
    __slots__ = ("address", "port", "key", "timeout_seconds", "backend")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    key: str
    timeout_seconds: float
    backend: str
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ..., key: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., backend: _Optional[str] = ...) -> None: ...

class OpenWeightsTransferResponse(_message.Message):
    __slots__ = ("ticket", "data_port", "ticket_ttl_seconds", "ranks")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    data_port: int
    ticket_ttl_seconds: float
    ranks: int
    def __init__(self, ticket: _Optional[bytes] = ..., data_port: _Optional[int] = ..., ticket_ttl_seconds: _Optional[float] = ..., ranks: _Optional[int] = ...) -> None: ...

class CommitWeightsRequest(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    def __init__(self, ticket: _Optional[bytes] = ...) -> None: ...

class AbortWeightsTransferRequest(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    def __init__(self, ticket: _Optional[bytes] = ...) -> None: ...

class AbortWeightsTransferResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetWeightsVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightsVersion(_message.Message):
    __slots__ = ("version", "checksum", "loaded_at_unix_ms", "model", "parent_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksum: str
    loaded_at_unix_ms: int
    model: str
    parent_version: int
    def __init__(self, version: _Optional[int] = ..., checksum: _Optional[str] = ..., loaded_at_unix_ms: _Optional[int] = ..., model: _Optional[str] = ..., parent_version: _Optional[int] = ...) -> None: ...
