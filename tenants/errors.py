"""Typed errors of the tenant registry (the gateway maps them to gRPC status codes)."""

from __future__ import annotations

import math


class TenantError(Exception):
    """Base class for tenant registry errors that are not bad input (bad input is ValueError).

    Attributes:
        name: the tenant name the operation was about.
    """

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name

    def __reduce__(self) -> tuple[object, ...]:
        # Pickling (Ray sends it from the scheduler actor) must rebuild from the name; the
        # default rebuilds from ``args`` (the message), which the subclasses would wrap again.
        if type(self) is TenantError:
            return (type(self), (self.name, str(self)))
        return (type(self), (self.name,))


class TenantExistsError(TenantError):
    """A tenant with this name is already registered (gRPC ALREADY_EXISTS)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, f"tenant {name!r} already exists")


class TenantNotFoundError(TenantError, LookupError):
    """No tenant with this name is registered (gRPC NOT_FOUND)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, f"tenant {name!r} not found")


class TooManyRotationsError(TenantError):
    """The tenant rotated its own key too often lately (gRPC RESOURCE_EXHAUSTED).

    Attributes:
        retry_after_s: seconds until it may rotate its key again.
    """

    def __init__(self, name: str, retry_after_s: float = 0.0) -> None:
        self.retry_after_s = retry_after_s
        # the whole seconds a Retry-After header says for the trailer (rounded up, at least 1);
        # regression (review 25b N1): the message rounded down ("retry in 0 s")
        super().__init__(name, f"tenant {name!r} rotated its own key too often; retry in "
                               f"{max(1, math.ceil(self.retry_after_ms / 1000))} s")

    @property
    def retry_after_ms(self) -> int:
        """The ``retry-after-ms`` trailer the gateway sends with it (never 0)."""
        return int(self.retry_after_s * 1000) + 1

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.retry_after_s))


class StaleKeyError(TenantError):
    """The key a call presented is no longer valid (gRPC UNAUTHENTICATED): it was rotated away
    or its tenant deleted (a tenant registered since under the same name has a new id and new
    keys), possibly through another gateway whose change this gateway's key cache has not seen
    yet. Nothing was changed. ``name`` is the tenant named by the call ("" for the admin key's
    own rotation)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, "this admin key is no longer valid: it was rotated (at this or another gateway)"
                         if not name else f"this key is no longer valid for tenant {name!r}: it was rotated away "
                         "or its tenant deleted (at this or another gateway)")


class NotOwnTenantError(TenantError):
    """A tenant's key asked about another tenant (gRPC PERMISSION_DENIED): a tenant key reaches
    only its own tenant."""

    def __init__(self, name: str) -> None:
        super().__init__(name, f"a tenant key reaches only its own tenant, not {name!r}")
