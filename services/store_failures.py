"""The gRPC status and advice for a failure of the scheduler's tenant store (``sqlite3.Error``),
from SQLite's result code: what the gateway answers a call whose store read or write failed,
over gRPC and (through ``services.openai_api.context``'s table) over HTTP alike.

=================================  ==================  ==============  ==========================
SQLite's result code               gRPC status         retry-after-ms  HTTP (OpenAI API)
=================================  ==================  ==============  ==========================
BUSY, LOCKED                       UNAVAILABLE         1000            503 + Retry-After: 1
FULL, READONLY, IOERR, CANTOPEN    UNAVAILABLE         10000           503 + Retry-After: 10
CORRUPT, NOTADB                    DATA_LOSS           (none)          500, x-should-retry: false
any other                          INTERNAL            (none)          500, x-should-retry: false
=================================  ==================  ==============  ==========================

Each is the server's trouble, never the client's: no 4xx (a full disk is not the caller's
rate limit: not RESOURCE_EXHAUSTED / 429). A retry may help the first two rows (the store
rolled its transaction back: nothing changed), and never the last two.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

BUSY_RETRY_AFTER_MS = 1000
"""The ``retry-after-ms`` of a store busy or locked by another connection (which holds it for
a transaction: milliseconds)."""

REPAIR_RETRY_AFTER_MS = 10_000
"""The ``retry-after-ms`` of a store whose disk is full, read-only or failing, or whose file
cannot be opened: an operator must act, a retry within a second would find it the same."""


@dataclass(frozen=True)
class StoreFailure:
    """What a call failing in the tenant store is answered.

    Attributes:
        code: the gRPC status.
        advice: what happened and what to do, for the client (names no path of the server's).
        retry_after_ms: the ``retry-after-ms`` trailer (HTTP ``Retry-After``), milliseconds;
            None: no retry helps.
    """

    code: grpc.StatusCode
    advice: str
    retry_after_ms: int | None


_STORE = "the tenant store (tenants.sqlite in the scheduler's state directory)"
_RESTORE = "restore it from a copy (see docs/architecture.md 'Tenants'), retrying will not help"
_STORE_FAILURES: dict[str, StoreFailure] = {
    "SQLITE_FULL": StoreFailure(grpc.StatusCode.UNAVAILABLE, (
        "the tenant store's disk is full; nothing changed; retry once it has room"), REPAIR_RETRY_AFTER_MS),
    "SQLITE_BUSY": StoreFailure(grpc.StatusCode.UNAVAILABLE, (
        "the tenant store is busy (another connection holds it); nothing changed; retry"), BUSY_RETRY_AFTER_MS),
    "SQLITE_LOCKED": StoreFailure(grpc.StatusCode.UNAVAILABLE, (
        "the tenant store is locked (another connection holds it); nothing changed; retry"), BUSY_RETRY_AFTER_MS),
    "SQLITE_CORRUPT": StoreFailure(grpc.StatusCode.DATA_LOSS, (
        f"{_STORE} is corrupt; nothing changed; {_RESTORE}"), None),
    "SQLITE_NOTADB": StoreFailure(grpc.StatusCode.DATA_LOSS, (
        f"{_STORE} is not an SQLite database (overwritten?); nothing changed; {_RESTORE}"), None),
    "SQLITE_READONLY": StoreFailure(grpc.StatusCode.UNAVAILABLE, (
        f"{_STORE} cannot be written (read-only file or file system); nothing changed; retry once "
        "the scheduler may write it"), REPAIR_RETRY_AFTER_MS),
    "SQLITE_IOERR": StoreFailure(grpc.StatusCode.UNAVAILABLE, (
        f"{_STORE}'s disk failed a read or write (I/O error); nothing changed; retry once the disk "
        "works"), REPAIR_RETRY_AFTER_MS),
    "SQLITE_CANTOPEN": StoreFailure(grpc.StatusCode.UNAVAILABLE, (
        f"{_STORE} (or its journal) cannot be opened; nothing changed; retry once its directory is "
        "there and writable"), REPAIR_RETRY_AFTER_MS),
}
_OTHER = StoreFailure(grpc.StatusCode.INTERNAL, "the tenant store failed; nothing changed; see the scheduler's log",
                      None)


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


def store_failure(exc: BaseException) -> StoreFailure:
    """What a call is answered whose tenant store failed with the ``sqlite3.Error`` ``exc``,
    from SQLite's result code (the module docstring's table). The store rolled its
    transaction back in each case: nothing changed.

    Regressions: (s40 diff review r7 of 01ed7ce) every store error was UNAVAILABLE 'retry once
    its disk has room', a corrupt or locked store's included; (s41) a full disk was
    RESOURCE_EXHAUSTED, which the HTTP API answers as the client's rate limit (429
    ``rate_limit_error``), and no failure carried ``retry-after-ms``: HTTP had no
    ``Retry-After``, and a corrupt store's 500 was retried by the ``openai`` client."""
    return _STORE_FAILURES.get(sqlite_error_name(exc), _OTHER)


async def abort_store_failure(context: grpc.aio.ServicerContext, method: str, exc: BaseException,
                              detail: str = "") -> None:
    """Abort the call whose ``method`` failed in the tenant store with ``exc``
    (``store_failure``'s status, its ``retry-after-ms`` trailer where a retry helps), logged.
    The message: "the scheduler's tenant store failed<detail>: <advice>" (``detail``: e.g. the
    store's own error, " (database is locked)"; never a path or a traceback).

    Raises:
        whatever ``context.abort`` raises (always)."""
    failure, cause = store_failure(exc), getattr(exc, "cause", None)
    log.warning("%s: the scheduler's tenant store failed (%s: %s), the call failed %s", method,
                sqlite_error_name(exc), cause if isinstance(cause, BaseException) else exc, failure.code.name)
    if failure.retry_after_ms is not None:
        context.set_trailing_metadata((("retry-after-ms", str(failure.retry_after_ms)),))
    await context.abort(failure.code, f"the scheduler's tenant store failed{detail}: {failure.advice}")
