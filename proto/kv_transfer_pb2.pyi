from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FetchRequest(_message.Message):
    __slots__ = ("request_id", "receiver_id", "dst_block_ids", "first_block")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    receiver_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    def __init__(self, request_id: _Optional[str] = ..., receiver_id: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("num_bytes", "num_chunks")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    num_chunks: int
    def __init__(self, num_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("reason", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SegmentNote(_message.Message):
    __slots__ = ("first_block", "block_ids", "checksums", "num_tokens", "final")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    final: bool
    def __init__(self, first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., final: _Optional[bool] = ...) -> None: ...

class Waiting(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("chunk", "done", "error", "segment", "waiting")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    done: Done
    error: Error
    segment: SegmentNote
    waiting: Waiting
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., segment: _Optional[_Union[SegmentNote, _Mapping]] = ..., waiting: _Optional[_Union[Waiting, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("alive",)
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    alive: bool
    def __init__(self, alive: _Optional[bool] = ...) -> None: ...
