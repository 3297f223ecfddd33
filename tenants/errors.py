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
