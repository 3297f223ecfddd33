"""Option bounds and checks shared by the commands."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import typer

from services import client_ids

MAX_UINT32, MAX_UINT64 = 2**32 - 1, 2**64 - 1
MAX_ID_CHARS = 256
"""The longest session id or ``cache_salt`` the gateway takes (``services.gateway_inputs.MAX_ID_CHARS``;
the CLI does not import the gateway's modules: tests/test_cli_imports.py)."""


def validation_message(error: dict[str, Any]) -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) as ``field: message``, a
    validator's own text without pydantic's "Value error, " prefix."""
    field = ".".join(map(str, error.get("loc", ())))
    raised = error.get("ctx", {}).get("error")
    message = str(raised) if error.get("type") == "value_error" and raised is not None else error["msg"]
    return f"{field}: {message}" if field else message


def uint64(value: int | None) -> int | None:
    """Typer callback: at most 2^64 - 1 (the wire's uint64), said in words rather than as a
    20-digit bound in ``--help``; None (an option not given) passes."""
    if value is not None and value > MAX_UINT64:
        raise typer.BadParameter(f"{value} does not fit in 64 bits (at most 2^64 - 1)")
    return value


def finite(value: float | None) -> float | None:
    """Typer callback: refuse nan and infinities (FloatRange lets nan through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def id_chars(option: str) -> Callable[[str], str]:
    """Typer callback for an id the server takes up to ``MAX_ID_CHARS`` (256) characters of
    (``services.gateway_inputs.MAX_ID_CHARS``: a session id, a ``cache_salt``), refused here
    as a usage error naming ``option`` rather than as the server's INVALID_ARGUMENT; so is one
    that is not text (bytes the locale could not decode, kept as lone surrogates: ``$'a\\xffb'``),
    which no request can carry, and one holding a character no client-named id may
    (``services.client_ids``: a control, line break or bidirectional formatting character).
    Regression (review r1 F5, session 37): such a ``--cache-salt`` or SESSION raised
    UnicodeEncodeError, a traceback with exit 1; (review r5, session 40) ``--session $'s\\nx'``
    was the server's INVALID_ARGUMENT with exit 1, not a usage error naming the option."""
    def check(value: str) -> str:
        if len(value) > MAX_ID_CHARS:
            raise typer.BadParameter(f"{option} has {len(value)} characters; at most {MAX_ID_CHARS}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise typer.BadParameter(f"{option} is not valid UTF-8 text (character {err.start + 1} is an "
                                     "undecodable byte)") from None
        why = client_ids.refusal(value)
        if why is not None:
            raise typer.BadParameter(f"{option} {why}")
        return value

    return check


def api_key(value: str | None) -> str | None:
    """Typer callback for ``--api-key`` / ``KVSTRATA_API_KEY``: the key without surrounding
    whitespace (a key is ``kvs_<12 hex>_<43 url-safe characters>``: a copied line's newline is
    no part of it); one that still holds whitespace, a control character or one past ASCII
    (typographic quotes pasted with it), which no gRPC header carries, is a usage error. None
    (not given) passes.

    Regression (s39 fresh-user trial): a key with a trailing newline (a pasted line) ended
    ``generate`` and ``tenant show`` with "INTERNAL: Invalid metadata" (as if the server had
    failed) after gRPC's C core logged "Metadata value for key authorization is invalid"."""
    if value is None:
        return None
    key = value.strip()
    # only ASCII's visible characters (regression, s39 review r3: a key pasted in typographic
    # quotes, or holding an "é", was sent: "INTERNAL: Invalid metadata", exit 1)
    if not key or any(not "!" <= c <= "~" for c in key):
        raise typer.BadParameter("the API key is empty or holds whitespace, a control character or one past "
                                 "ASCII; a key reads kvs_<key id>_<secret>, as `kvstrata tenant add` printed it")
    return key


def positive(value: float) -> float:
    """Typer callback: a finite number > 0."""
    if not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} is not a finite number > 0")
    return value


GatewayOpt = typer.Option(
    None, "--gateway", metavar="HOST:PORT",
    help="the gateway to call (default: $KVSTRATA_GATEWAY, else the address `kvstrata up` saved)")
TenantNameArg = typer.Argument(..., metavar="NAME", help="the tenant's name (as given to `kvstrata tenant add`)")
"""Arguments are written in capitals everywhere (``NAME``, ``PROMPT``), as click writes them."""
