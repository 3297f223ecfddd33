"""Tenants: model and SLO classes, API keys, the persistent registry, usage accounting.

Plain Python: nothing here imports Ray, gRPC or protobuf.
"""

from tenants.errors import TenantError, TenantExistsError, TenantNotFoundError
from tenants.model import SLO_CLASS_DEFAULTS, SloClass, SloDefaults, Tenant, TenantSpec
from tenants.store import TenantStore
from tenants.usage import TIERS, TenantUsage, TierTokens, UsageLedger

__all__ = [
    "SLO_CLASS_DEFAULTS",
    "TIERS",
    "SloClass",
    "SloDefaults",
    "Tenant",
    "TenantError",
    "TenantExistsError",
    "TenantNotFoundError",
    "TenantSpec",
    "TenantStore",
    "TenantUsage",
    "TierTokens",
    "UsageLedger",
]
