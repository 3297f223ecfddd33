from kvstrata.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TenantSpec(_message.Message):
    __slots__ = ("name", "slo_class", "ttft_slo_ms", "tpot_slo_ms", "min_tokens_per_s", "weight", "kv_quota_bytes", "max_context_tokens", "cache_namespace", "policy", "allowed_policies")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_POLICIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    slo_class: _common_pb2.SloClass
    ttft_slo_ms: float
    tpot_slo_ms: float
    min_tokens_per_s: float
    weight: float
    kv_quota_bytes: int
    max_context_tokens: int
    cache_namespace: str
    policy: str
    allowed_policies: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., slo_class: _Optional[_Union[_common_pb2.SloClass, str]] = ..., ttft_slo_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ..., min_tokens_per_s: _Optional[float] = ..., weight: _Optional[float] = ..., kv_quota_bytes: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., cache_namespace: _Optional[str] = ..., policy: _Optional[str] = ..., allowed_policies: _Optional[_Iterable[str]] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("tenant_id", "spec", "created_at_s")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_S_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    spec: TenantSpec
    created_at_s: float
    def __init__(self, tenant_id: _Optional[str] = ..., spec: _Optional[_Union[TenantSpec, _Mapping]] = ..., created_at_s: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("tenant_id", "prompt_tokens", "completion_tokens", "cached_tokens", "blocks_held", "requests", "rejected", "preempted", "session_blocks_held")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    SESSION_BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: _common_pb2.TierTokens
    blocks_held: int
    requests: int
    rejected: int
    preempted: int
    session_blocks_held: int
    def __init__(self, tenant_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[_Union[_common_pb2.TierTokens, _Mapping]] = ..., blocks_held: _Optional[int] = ..., requests: _Optional[int] = ..., rejected: _Optional[int] = ..., preempted: _Optional[int] = ..., session_blocks_held: _Optional[int] = ...) -> None: ...

class RegisterTenantRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: TenantSpec
    def __init__(self, spec: _Optional[_Union[TenantSpec, _Mapping]] = ...) -> None: ...

class RegisterTenantResponse(_message.Message):
    __slots__ = ("tenant", "api_key")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    api_key: str
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ..., api_key: _Optional[str] = ...) -> None: ...

class UpdateTenantRequest(_message.Message):
    __slots__ = ("name", "spec")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: TenantSpec
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[TenantSpec, _Mapping]] = ...) -> None: ...

class UpdateTenantResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class DeleteTenantRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTenantResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTenantRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetTenantResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("usage",)
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class RotateKeyRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RotateKeyResponse(_message.Message):
    __slots__ = ("api_key",)
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    api_key: str
    def __init__(self, api_key: _Optional[str] = ...) -> None: ...
