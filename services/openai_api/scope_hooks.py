"""What the app asks of the connection serving a request, through its ASGI scope: the guarded
protocol (``services.openai_api.protocol``) puts a callable for each in every request's scope
(``marking``); a request served otherwise (a test's plain app) finds none, and each ask is a
no-op there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

AUTHENTICATED = "kvstrata.authenticated"
"""The ASGI scope key of a callable that marks the request's connection as having presented a
valid API key (``authenticated``)."""


END_UNFINISHED = "kvstrata.end_unfinished"
"""A request scope's key for its connection's ``Guarded._end_unfinished``."""

WRITTEN = "kvstrata.written"
"""A request scope's key for its connection's ``Guarded._written``."""


def marking(app: Any, mark: Callable[[], None], end_unfinished: Callable[[], None],
             written: Callable[[], Awaitable[None]]) -> Any:
    """``app`` with ``mark`` (``AUTHENTICATED``), ``end_unfinished`` (``END_UNFINISHED``) and
    ``written`` (``WRITTEN``) in each request's scope (the scope uvicorn's request cycle holds,
    which middleware may copy)."""

    async def marked(scope: Any, receive: Any, send: Any) -> None:
        scope[AUTHENTICATED] = mark
        scope[END_UNFINISHED] = end_unfinished
        scope[WRITTEN] = written
        await app(scope, receive, send)
    return marked


async def written(scope: Any) -> None:
    """Return once the connection of ``scope`` has written out what its response handed it (its
    transport holds at most its low-water mark), or is gone; at once when no guarded protocol
    serves it."""
    wait = scope.get(WRITTEN)
    if wait is not None:
        await wait()


def end_unfinished(scope: Any) -> None:
    """The app ends the response of ``scope`` unfinished, on purpose, and returns: its connection,
    when served by a guarded protocol, is closed after what its transport holds, as uvicorn closes
    it for an app that returns mid-response, but without uvicorn's ERROR log ("ASGI callable
    returned without completing response"), which is for a broken app."""
    end = scope.get(END_UNFINISHED)
    if end is not None:
        end()


def authenticated(scope: Any) -> None:
    """The request of ``scope`` presented a valid API key: its connection, when served by a
    guarded protocol, leaves the unauthenticated pool (``ConnectionGuard``)."""
    mark = scope.get(AUTHENTICATED)
    if mark is not None:
        mark()
