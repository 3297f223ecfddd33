"""Typed errors of the tenant registry (the gateway maps them to gRPC status codes)."""

from __future__ import annotations


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
        super().__init__(name, f"tenant {name!r} rotated its own key too often; retry in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.retry_after_s))
