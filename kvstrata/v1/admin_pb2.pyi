from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeStats(_message.Message):
    __slots__ = ("node_id", "num_blocks", "free_blocks", "cached_blocks", "used_blocks", "block_size", "device_bytes_used", "host_bytes_used", "running", "waiting", "integrity_ok", "integrity_error", "session_blocks", "prefix_blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_OK_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    SESSION_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    block_size: int
    device_bytes_used: int
    host_bytes_used: int
    running: int
    waiting: int
    integrity_ok: bool
    integrity_error: str
    session_blocks: int
    prefix_blocks: int
    def __init__(self, node_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., device_bytes_used: _Optional[int] = ..., host_bytes_used: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., integrity_ok: _Optional[bool] = ..., integrity_error: _Optional[str] = ..., session_blocks: _Optional[int] = ..., prefix_blocks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("check_integrity",)
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    check_integrity: bool
    def __init__(self, check_integrity: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("nodes", "queued", "sessions", "stats_json")
    NODES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStats]
    queued: int
    sessions: int
    stats_json: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStats, _Mapping]]] = ..., queued: _Optional[int] = ..., sessions: _Optional[int] = ..., stats_json: _Optional[str] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("freed_blocks", "device_blocks", "prefix_blocks", "host_blocks", "spill_blocks", "skipped_nodes")
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPILL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_NODES_FIELD_NUMBER: _ClassVar[int]
    freed_blocks: int
    device_blocks: int
    prefix_blocks: int
    host_blocks: int
    spill_blocks: int
    skipped_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, freed_blocks: _Optional[int] = ..., device_blocks: _Optional[int] = ..., prefix_blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ..., spill_blocks: _Optional[int] = ..., skipped_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("aborted", "skipped_nodes")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_NODES_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    skipped_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted: _Optional[int] = ..., skipped_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class RotateAdminKeyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RotateAdminKeyResponse(_message.Message):
    __slots__ = ("api_key",)
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    api_key: str
    def __init__(self, api_key: _Optional[str] = ...) -> None: ...
