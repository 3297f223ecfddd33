"""The gRPC status and advice for a failure of the scheduler's tenant store (``sqlite3.Error``),
from SQLite's result code: what the gateway answers a call whose store read or write failed.
"""

from __future__ import annotations

import grpc

_STORE = "the tenant store (tenants.sqlite in the scheduler's state directory)"
_STORE_FAILURES: dict[str, tuple[grpc.StatusCode, str]] = {
    "SQLITE_FULL": (grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "the tenant store's disk is full; nothing changed; retry once it has room"),
    "SQLITE_BUSY": (grpc.StatusCode.UNAVAILABLE,
                    "the tenant store is busy (another connection holds it); nothing changed; retry"),
    "SQLITE_LOCKED": (grpc.StatusCode.UNAVAILABLE,
                      "the tenant store is locked (another connection holds it); nothing changed; retry"),
    "SQLITE_CORRUPT": (grpc.StatusCode.DATA_LOSS,
                       (f"{_STORE} is corrupt; nothing changed; restore it from a copy (see "
                       "docs/architecture.md 'Tenants'), retrying will not help")),
    "SQLITE_NOTADB": (grpc.StatusCode.DATA_LOSS,
                      (f"{_STORE} is not an SQLite database (overwritten?); nothing changed; restore "
                      "it from a copy (see docs/architecture.md 'Tenants'), retrying will not help")),
    "SQLITE_READONLY": (grpc.StatusCode.UNAVAILABLE,
                        (f"{_STORE} cannot be written (read-only file or file system); nothing "
                        "changed; retry once the scheduler may write it")),
    "SQLITE_IOERR": (grpc.StatusCode.UNAVAILABLE,
                     (f"{_STORE}'s disk failed a read or write (I/O error); nothing changed; retry "
                     "once the disk works")),
    "SQLITE_CANTOPEN": (grpc.StatusCode.UNAVAILABLE,
                        (f"{_STORE} (or its journal) cannot be opened; nothing changed; retry once "
                        "its directory is there and writable")),
}


def sqlite_error_name(exc: BaseException) -> str:
    """The name of SQLite's primary result code of ``exc`` (or of the error Ray's task error
    carries as ``cause``): "SQLITE_FULL", "SQLITE_BUSY"...; "" when it has none (an error
    raised by the sqlite3 module itself, such as a closed connection's ProgrammingError)."""
    cause = getattr(exc, "cause", None)
    err = cause if isinstance(cause, BaseException) else exc
    name = getattr(err, "sqlite_errorname", None)
    if not isinstance(name, str):
        return ""
    for primary in _STORE_FAILURES:  # an extended code's name (SQLITE_IOERR_WRITE...)
        if name.startswith(primary + "_"):
            return primary
    return name


def store_failure(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and the advice (after the store's own message) for the tenant store's
    ``sqlite3.Error`` ``exc``, from SQLite's result code: FULL is RESOURCE_EXHAUSTED (the file
    system out of space); BUSY, LOCKED, READONLY, IOERR and CANTOPEN are UNAVAILABLE naming
    the cause; CORRUPT and NOTADB are DATA_LOSS (retrying cannot help); any other (or none)
    INTERNAL. The store rolled its transaction back in each case: nothing changed.

    Regression (s40 diff review r7 of 01ed7ce): every store error was UNAVAILABLE 'retry once
    its disk has room', a corrupt or locked store's included."""
    return _STORE_FAILURES.get(sqlite_error_name(exc), (
        grpc.StatusCode.INTERNAL, "the tenant store failed; nothing changed; see the scheduler's log"))
