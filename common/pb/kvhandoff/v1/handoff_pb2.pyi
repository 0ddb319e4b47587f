from common.pb.kvhandoff.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataPlane(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_PLANE_UNSPECIFIED: _ClassVar[DataPlane]
    DATA_PLANE_INLINE: _ClassVar[DataPlane]
    DATA_PLANE_SHARED_MEMORY: _ClassVar[DataPlane]
    DATA_PLANE_NIXL: _ClassVar[DataPlane]

class HandoffStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_STATUS_UNSPECIFIED: _ClassVar[HandoffStatus]
    HANDOFF_STATUS_OK: _ClassVar[HandoffStatus]
    HANDOFF_STATUS_REJECTED: _ClassVar[HandoffStatus]
    HANDOFF_STATUS_ABORTED: _ClassVar[HandoffStatus]
DATA_PLANE_UNSPECIFIED: DataPlane
DATA_PLANE_INLINE: DataPlane
DATA_PLANE_SHARED_MEMORY: DataPlane
DATA_PLANE_NIXL: DataPlane
HANDOFF_STATUS_UNSPECIFIED: HandoffStatus
HANDOFF_STATUS_OK: HandoffStatus
HANDOFF_STATUS_REJECTED: HandoffStatus
HANDOFF_STATUS_ABORTED: HandoffStatus

class DataPlaneOffer(_message.Message):
    __slots__ = ("plane", "host_id", "nixl_agent_metadata")
    PLANE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    plane: DataPlane
    host_id: str
    nixl_agent_metadata: bytes
    def __init__(self, plane: _Optional[_Union[DataPlane, str]] = ..., host_id: _Optional[str] = ..., nixl_agent_metadata: _Optional[bytes] = ...) -> None: ...

class KvRegionRef(_message.Message):
    __slots__ = ("region", "k_offset", "v_offset", "length", "nixl_address", "nixl_buffer_size", "nixl_buffer_metadata")
    REGION_FIELD_NUMBER: _ClassVar[int]
    K_OFFSET_FIELD_NUMBER: _ClassVar[int]
    V_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NIXL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NIXL_BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    NIXL_BUFFER_METADATA_FIELD_NUMBER: _ClassVar[int]
    region: str
    k_offset: int
    v_offset: int
    length: int
    nixl_address: int
    nixl_buffer_size: int
    nixl_buffer_metadata: bytes
    def __init__(self, region: _Optional[str] = ..., k_offset: _Optional[int] = ..., v_offset: _Optional[int] = ..., length: _Optional[int] = ..., nixl_address: _Optional[int] = ..., nixl_buffer_size: _Optional[int] = ..., nixl_buffer_metadata: _Optional[bytes] = ...) -> None: ...

class ReleaseHandoffRequest(_message.Message):
    __slots__ = ("request_id", "nonce")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    nonce: bytes
    def __init__(self, request_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ReleaseHandoffResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "protocol_version", "model_fingerprint", "sampling", "max_chunk_bytes", "nonce", "data_plane", "data_plane_host_id", "cache_scope")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    protocol_version: _common_pb2.ProtocolVersion
    model_fingerprint: str
    sampling: _common_pb2.SamplingParams
    max_chunk_bytes: int
    nonce: bytes
    data_plane: DataPlane
    data_plane_host_id: str
    cache_scope: bytes
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., protocol_version: _Optional[_Union[_common_pb2.ProtocolVersion, _Mapping]] = ..., model_fingerprint: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_chunk_bytes: _Optional[int] = ..., nonce: _Optional[bytes] = ..., data_plane: _Optional[_Union[DataPlane, str]] = ..., data_plane_host_id: _Optional[str] = ..., cache_scope: _Optional[bytes] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: HandoffHeader
    chunk: KvChunk
    commit: HandoffCommit
    def __init__(self, header: _Optional[_Union[HandoffHeader, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ..., commit: _Optional[_Union[HandoffCommit, _Mapping]] = ...) -> None: ...

class HandoffHeader(_message.Message):
    __slots__ = ("protocol_version", "request_id", "token_count", "status", "reason", "layout", "model_fingerprint", "reason_code", "nonce", "prompt_digest")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    protocol_version: _common_pb2.ProtocolVersion
    request_id: str
    token_count: int
    status: HandoffStatus
    reason: str
    layout: _common_pb2.KvLayout
    model_fingerprint: str
    reason_code: str
    nonce: bytes
    prompt_digest: bytes
    def __init__(self, protocol_version: _Optional[_Union[_common_pb2.ProtocolVersion, _Mapping]] = ..., request_id: _Optional[str] = ..., token_count: _Optional[int] = ..., status: _Optional[_Union[HandoffStatus, str]] = ..., reason: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., model_fingerprint: _Optional[str] = ..., reason_code: _Optional[str] = ..., nonce: _Optional[bytes] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("request_id", "sequence_number", "layer", "token_start", "token_end", "k", "v", "crc32c", "nonce", "chunk_crc32c", "ref")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CRC32C_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sequence_number: int
    layer: int
    token_start: int
    token_end: int
    k: bytes
    v: bytes
    crc32c: int
    nonce: bytes
    chunk_crc32c: int
    ref: KvRegionRef
    def __init__(self, request_id: _Optional[str] = ..., sequence_number: _Optional[int] = ..., layer: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., nonce: _Optional[bytes] = ..., chunk_crc32c: _Optional[int] = ..., ref: _Optional[_Union[KvRegionRef, _Mapping]] = ...) -> None: ...

class HandoffCommit(_message.Message):
    __slots__ = ("request_id", "token_count", "chunk_count", "first_token_id", "status", "reason", "nonce", "commit_crc32c", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_CRC32C_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_count: int
    chunk_count: int
    first_token_id: int
    status: HandoffStatus
    reason: str
    nonce: bytes
    commit_crc32c: int
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_count: _Optional[int] = ..., chunk_count: _Optional[int] = ..., first_token_id: _Optional[int] = ..., status: _Optional[_Union[HandoffStatus, str]] = ..., reason: _Optional[str] = ..., nonce: _Optional[bytes] = ..., commit_crc32c: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GetPrefillInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPrefillInfoResponse(_message.Message):
    __slots__ = ("model_fingerprint", "layout", "page_size", "protocol_versions", "max_prompt_tokens", "max_context_tokens", "vocab_size", "data_planes")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANES_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    layout: _common_pb2.KvLayout
    page_size: int
    protocol_versions: _containers.RepeatedCompositeFieldContainer[_common_pb2.ProtocolVersion]
    max_prompt_tokens: int
    max_context_tokens: int
    vocab_size: int
    data_planes: _containers.RepeatedCompositeFieldContainer[DataPlaneOffer]
    def __init__(self, model_fingerprint: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., page_size: _Optional[int] = ..., protocol_versions: _Optional[_Iterable[_Union[_common_pb2.ProtocolVersion, _Mapping]]] = ..., max_prompt_tokens: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., data_planes: _Optional[_Iterable[_Union[DataPlaneOffer, _Mapping]]] = ...) -> None: ...
