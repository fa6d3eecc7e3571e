from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "model")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    model: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("seq_id", "token_ids", "max_cached_tokens", "expect_cached_tokens", "tenant_salt", "max_blocks", "attention", "first_position", "order_nonce", "prompt_tokens", "prompt_key")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECT_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    ORDER_NONCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_cached_tokens: int
    expect_cached_tokens: int
    tenant_salt: bytes
    max_blocks: int
    attention: _containers.RepeatedCompositeFieldContainer[LayerAttention]
    first_position: int
    order_nonce: bytes
    prompt_tokens: int
    prompt_key: bytes
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_cached_tokens: _Optional[int] = ..., expect_cached_tokens: _Optional[int] = ..., tenant_salt: _Optional[bytes] = ..., max_blocks: _Optional[int] = ..., attention: _Optional[_Iterable[_Union[LayerAttention, _Mapping]]] = ..., first_position: _Optional[int] = ..., order_nonce: _Optional[bytes] = ..., prompt_tokens: _Optional[int] = ..., prompt_key: _Optional[bytes] = ...) -> None: ...

class SignedOpen(_message.Message):
    __slots__ = ("order", "tag", "expires_at", "epoch", "node_id", "token_ids", "packed_token_ids")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    order: bytes
    tag: bytes
    expires_at: int
    epoch: int
    node_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_token_ids: bytes
    def __init__(self, order: _Optional[bytes] = ..., tag: _Optional[bytes] = ..., expires_at: _Optional[int] = ..., epoch: _Optional[int] = ..., node_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., packed_token_ids: _Optional[bytes] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("num_cached_tokens", "num_host_hit_tokens")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    num_host_hit_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ..., num_host_hit_tokens: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("token_ids", "tenant_salt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant_salt: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tenant_salt: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class AppendChunk(_message.Message):
    __slots__ = ("header", "data", "num_tokens")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    header: AppendHeader
    data: bytes
    num_tokens: int
    def __init__(self, header: _Optional[_Union[AppendHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AppendHeader(_message.Message):
    __slots__ = ("seq_id", "token_ids", "kv")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv: TensorHeader
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., kv: _Optional[_Union[TensorHeader, _Mapping]] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("num_tokens",)
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    def __init__(self, num_tokens: _Optional[int] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("seq_ids", "layer", "q", "k", "v", "token_ids", "return_block_mass", "appends")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_BLOCK_MASS_FIELD_NUMBER: _ClassVar[int]
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    layer: int
    q: Tensor
    k: Tensor
    v: Tensor
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_block_mass: bool
    appends: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., layer: _Optional[int] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., return_block_mass: _Optional[bool] = ..., appends: _Optional[_Iterable[bool]] = ...) -> None: ...

class AttendPrefillRequest(_message.Message):
    __slots__ = ("seq_id", "layer", "q", "k", "v", "token_ids", "return_block_mass", "query_position")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_BLOCK_MASS_FIELD_NUMBER: _ClassVar[int]
    QUERY_POSITION_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    layer: int
    q: Tensor
    k: Tensor
    v: Tensor
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_block_mass: bool
    query_position: int
    def __init__(self, seq_id: _Optional[str] = ..., layer: _Optional[int] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., return_block_mass: _Optional[bool] = ..., query_position: _Optional[int] = ...) -> None: ...

class AttendPrefillBatchRequest(_message.Message):
    __slots__ = ("seq_ids", "layer", "num_tokens", "q", "k", "v", "token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    layer: int
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: Tensor
    k: Tensor
    v: Tensor
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., layer: _Optional[int] = ..., num_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("out", "lse", "block_mass")
    OUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MASS_FIELD_NUMBER: _ClassVar[int]
    out: Tensor
    lse: Tensor
    block_mass: Tensor
    def __init__(self, out: _Optional[_Union[Tensor, _Mapping]] = ..., lse: _Optional[_Union[Tensor, _Mapping]] = ..., block_mass: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("parent_id", "child_id", "max_blocks")
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    parent_id: str
    child_id: str
    max_blocks: int
    def __init__(self, parent_id: _Optional[str] = ..., child_id: _Optional[str] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class SeqRequest(_message.Message):
    __slots__ = ("seq_id", "keep_prefix")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREFIX_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    keep_prefix: int
    def __init__(self, seq_id: _Optional[str] = ..., keep_prefix: _Optional[int] = ...) -> None: ...

class SwapResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class ReadKVRequest(_message.Message):
    __slots__ = ("seq_id", "start", "end", "chunk_bytes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    start: int
    end: int
    chunk_bytes: int
    def __init__(self, seq_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data", "num_tokens")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    data: bytes
    num_tokens: int
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("token_ids", "tenant_salt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant_salt: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tenant_salt: _Optional[bytes] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("num_tokens",)
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    def __init__(self, num_tokens: _Optional[int] = ...) -> None: ...

class SetBudgetRequest(_message.Message):
    __slots__ = ("seq_id", "max_tokens", "sink_blocks", "recent_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SINK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    max_tokens: int
    sink_blocks: int
    recent_blocks: int
    def __init__(self, seq_id: _Optional[str] = ..., max_tokens: _Optional[int] = ..., sink_blocks: _Optional[int] = ..., recent_blocks: _Optional[int] = ...) -> None: ...

class MassQueries(_message.Message):
    __slots__ = ("layer", "q", "lse", "visible")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    q: Tensor
    lse: _containers.RepeatedScalarFieldContainer[float]
    visible: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., lse: _Optional[_Iterable[float]] = ..., visible: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockMassRequest(_message.Message):
    __slots__ = ("seq_id", "queries", "accumulated")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    queries: _containers.RepeatedCompositeFieldContainer[MassQueries]
    accumulated: bool
    def __init__(self, seq_id: _Optional[str] = ..., queries: _Optional[_Iterable[_Union[MassQueries, _Mapping]]] = ..., accumulated: _Optional[bool] = ...) -> None: ...

class BlockMassResponse(_message.Message):
    __slots__ = ("mass", "num_cached_tokens")
    MASS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mass: _containers.RepeatedScalarFieldContainer[float]
    num_cached_tokens: int
    def __init__(self, mass: _Optional[_Iterable[float]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class DropBlocksRequest(_message.Message):
    __slots__ = ("seq_id", "indices")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class DropBlocksResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("counters", "spec", "device", "policy", "bulk_port", "epoch", "is_fenced")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    IS_FENCED_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    spec: ModelSpec
    device: str
    policy: str
    bulk_port: int
    epoch: int
    is_fenced: bool
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., device: _Optional[str] = ..., policy: _Optional[str] = ..., bulk_port: _Optional[int] = ..., epoch: _Optional[int] = ..., is_fenced: _Optional[bool] = ...) -> None: ...

class CheckIntegrityResponse(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("free_blocks", "cached_blocks", "used_blocks", "num_blocks", "host_free_blocks", "num_sequences")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    num_blocks: int
    host_free_blocks: int
    num_sequences: int
    def __init__(self, free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., host_free_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "address", "spec", "num_blocks", "num_host_blocks", "metrics_address", "policy", "epoch", "adapts_lease")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADAPTS_LEASE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    spec: ModelSpec
    num_blocks: int
    num_host_blocks: int
    metrics_address: str
    policy: str
    epoch: int
    adapts_lease: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., num_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., metrics_address: _Optional[str] = ..., policy: _Optional[str] = ..., epoch: _Optional[int] = ..., adapts_lease: _Optional[bool] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_ttl_s", "heartbeat_interval_s", "epoch", "lost_seq_ids", "frame_port", "takes_one_way_reports")
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOST_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FRAME_PORT_FIELD_NUMBER: _ClassVar[int]
    TAKES_ONE_WAY_REPORTS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_s: float
    heartbeat_interval_s: float
    epoch: int
    lost_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    frame_port: int
    takes_one_way_reports: bool
    def __init__(self, lease_ttl_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., epoch: _Optional[int] = ..., lost_seq_ids: _Optional[_Iterable[str]] = ..., frame_port: _Optional[int] = ..., takes_one_way_reports: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "load", "held_seq_ids", "held_complete", "events_epoch", "lease_ttl_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HELD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    HELD_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    load: NodeLoad
    held_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    held_complete: bool
    events_epoch: int
    lease_ttl_s: float
    def __init__(self, node_id: _Optional[str] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., held_seq_ids: _Optional[_Iterable[str]] = ..., held_complete: _Optional[bool] = ..., events_epoch: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("is_registered", "frame_port", "takes_one_way_reports", "applied_seq", "next_seq", "lease_ttl_s", "heartbeat_interval_s", "free_seq_ids")
    IS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    FRAME_PORT_FIELD_NUMBER: _ClassVar[int]
    TAKES_ONE_WAY_REPORTS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    FREE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    is_registered: bool
    frame_port: int
    takes_one_way_reports: bool
    applied_seq: int
    next_seq: int
    lease_ttl_s: float
    heartbeat_interval_s: float
    free_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, is_registered: _Optional[bool] = ..., frame_port: _Optional[int] = ..., takes_one_way_reports: _Optional[bool] = ..., applied_seq: _Optional[int] = ..., next_seq: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., free_seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("kind", "key")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BlockEvent.Kind]
        STORED: _ClassVar[BlockEvent.Kind]
        REMOVED: _ClassVar[BlockEvent.Kind]
        OFFLOADED: _ClassVar[BlockEvent.Kind]
    KIND_UNSPECIFIED: BlockEvent.Kind
    STORED: BlockEvent.Kind
    REMOVED: BlockEvent.Kind
    OFFLOADED: BlockEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    kind: BlockEvent.Kind
    key: bytes
    def __init__(self, kind: _Optional[_Union[BlockEvent.Kind, str]] = ..., key: _Optional[bytes] = ...) -> None: ...

class ReportEventsRequest(_message.Message):
    __slots__ = ("node_id", "events", "load", "epoch", "first_seq", "base_seq")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_SEQ_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    load: NodeLoad
    epoch: int
    first_seq: int
    base_seq: int
    def __init__(self, node_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., epoch: _Optional[int] = ..., first_seq: _Optional[int] = ..., base_seq: _Optional[int] = ...) -> None: ...

class ReportEventsResponse(_message.Message):
    __slots__ = ("num_events", "applied_seq", "next_seq")
    NUM_EVENTS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    num_events: int
    applied_seq: int
    next_seq: int
    def __init__(self, num_events: _Optional[int] = ..., applied_seq: _Optional[int] = ..., next_seq: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("node_id", "address", "first_token", "ticket")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    first_token: int
    ticket: bytes
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., first_token: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class CoordOpenRequest(_message.Message):
    __slots__ = ("seq_id", "token_ids", "packed_token_ids", "max_cached_tokens", "spec", "attention", "explain_miss", "request_id", "worker_opens", "carries_prompt", "prefix_ref", "prefix_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_MISS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_OPENS_FIELD_NUMBER: _ClassVar[int]
    CARRIES_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REF_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_token_ids: bytes
    max_cached_tokens: int
    spec: ModelSpec
    attention: _containers.RepeatedCompositeFieldContainer[LayerAttention]
    explain_miss: bool
    request_id: str
    worker_opens: bool
    carries_prompt: bool
    prefix_ref: bytes
    prefix_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., packed_token_ids: _Optional[bytes] = ..., max_cached_tokens: _Optional[int] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., attention: _Optional[_Iterable[_Union[LayerAttention, _Mapping]]] = ..., explain_miss: _Optional[bool] = ..., request_id: _Optional[str] = ..., worker_opens: _Optional[bool] = ..., carries_prompt: _Optional[bool] = ..., prefix_ref: _Optional[bytes] = ..., prefix_tokens: _Optional[int] = ...) -> None: ...

class CoordOpenResponse(_message.Message):
    __slots__ = ("extents", "num_cached_tokens", "num_host_hit_tokens", "num_blocks", "miss", "node_seq_id", "node_open", "frame_port", "takes_packed_prompts", "num_pending_tokens", "prompt_ref", "prompt_ref_tokens", "block_size")
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_FIELD_NUMBER: _ClassVar[int]
    NODE_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_OPEN_FIELD_NUMBER: _ClassVar[int]
    FRAME_PORT_FIELD_NUMBER: _ClassVar[int]
    TAKES_PACKED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_REF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_REF_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    extents: _containers.RepeatedCompositeFieldContainer[Placement]
    num_cached_tokens: int
    num_host_hit_tokens: int
    num_blocks: int
    miss: MissExplanation
    node_seq_id: str
    node_open: SignedOpen
    frame_port: int
    takes_packed_prompts: bool
    num_pending_tokens: int
    prompt_ref: bytes
    prompt_ref_tokens: int
    block_size: int
    def __init__(self, extents: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., num_host_hit_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., miss: _Optional[_Union[MissExplanation, _Mapping]] = ..., node_seq_id: _Optional[str] = ..., node_open: _Optional[_Union[SignedOpen, _Mapping]] = ..., frame_port: _Optional[int] = ..., takes_packed_prompts: _Optional[bool] = ..., num_pending_tokens: _Optional[int] = ..., prompt_ref: _Optional[bytes] = ..., prompt_ref_tokens: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class CoordLookupRequest(_message.Message):
    __slots__ = ("token_ids", "spec")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    spec: ModelSpec
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ...) -> None: ...

class CoordLookupResponse(_message.Message):
    __slots__ = ("num_cached_tokens", "node_id")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    node_id: str
    def __init__(self, num_cached_tokens: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class CoordSeqRequest(_message.Message):
    __slots__ = ("seq_id", "keep_prefix", "node_not_found", "freed_extents")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NODE_NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    FREED_EXTENTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    keep_prefix: int
    node_not_found: bool
    freed_extents: int
    def __init__(self, seq_id: _Optional[str] = ..., keep_prefix: _Optional[int] = ..., node_not_found: _Optional[bool] = ..., freed_extents: _Optional[int] = ...) -> None: ...

class CoordExtendRequest(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "attention")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_tokens: int
    attention: _containers.RepeatedCompositeFieldContainer[LayerAttention]
    def __init__(self, seq_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., attention: _Optional[_Iterable[_Union[LayerAttention, _Mapping]]] = ...) -> None: ...

class CoordForkRequest(_message.Message):
    __slots__ = ("parent_id", "child_id")
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_ID_FIELD_NUMBER: _ClassVar[int]
    parent_id: str
    child_id: str
    def __init__(self, parent_id: _Optional[str] = ..., child_id: _Optional[str] = ...) -> None: ...

class CoordPinRequest(_message.Message):
    __slots__ = ("token_ids", "spec")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    spec: ModelSpec
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ...) -> None: ...

class CoordStatsResponse(_message.Message):
    __slots__ = ("counters", "nodes")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    nodes: _containers.RepeatedCompositeFieldContainer[RegisterRequest]
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ..., nodes: _Optional[_Iterable[_Union[RegisterRequest, _Mapping]]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("node_id", "seq_id", "min_blocks", "num_blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    seq_id: str
    min_blocks: int
    num_blocks: int
    def __init__(self, node_id: _Optional[str] = ..., seq_id: _Optional[str] = ..., min_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("max_blocks",)
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    max_blocks: int
    def __init__(self, max_blocks: _Optional[int] = ...) -> None: ...

class LayerAttention(_message.Message):
    __slots__ = ("window", "chunk", "softcap", "scale")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SOFTCAP_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    window: int
    chunk: int
    softcap: float
    scale: float
    def __init__(self, window: _Optional[int] = ..., chunk: _Optional[int] = ..., softcap: _Optional[float] = ..., scale: _Optional[float] = ...) -> None: ...

class MissExplanation(_message.Message):
    __slots__ = ("reason", "first_block", "node_id", "policy", "cached_elsewhere_blocks")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[MissExplanation.Reason]
        NONE: _ClassVar[MissExplanation.Reason]
        HOST_TIER: _ClassVar[MissExplanation.Reason]
        IN_FLIGHT: _ClassVar[MissExplanation.Reason]
        OTHER_NODE: _ClassVar[MissExplanation.Reason]
        EVICTED: _ClassVar[MissExplanation.Reason]
        NOT_CACHED: _ClassVar[MissExplanation.Reason]
    REASON_UNSPECIFIED: MissExplanation.Reason
    NONE: MissExplanation.Reason
    HOST_TIER: MissExplanation.Reason
    IN_FLIGHT: MissExplanation.Reason
    OTHER_NODE: MissExplanation.Reason
    EVICTED: MissExplanation.Reason
    NOT_CACHED: MissExplanation.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CACHED_ELSEWHERE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reason: MissExplanation.Reason
    first_block: int
    node_id: str
    policy: str
    cached_elsewhere_blocks: int
    def __init__(self, reason: _Optional[_Union[MissExplanation.Reason, str]] = ..., first_block: _Optional[int] = ..., node_id: _Optional[str] = ..., policy: _Optional[str] = ..., cached_elsewhere_blocks: _Optional[int] = ...) -> None: ...
