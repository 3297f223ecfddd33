"""The API key a call presents: its ``authorization`` metadata (gRPC), which the HTTP API's
``Authorization`` header becomes (``openai_api.context.HttpCallContext``), ``Bearer <key>``."""

from __future__ import annotations

from typing import Any


def bearer_key(context: Any) -> str:
    """The API key of the call's ``authorization`` metadata (the HTTP API's header): what
    follows its scheme ``Bearer``, in any case ("" when there is none, or another scheme).

    Regression (s39): ``authorization: bearer <key>`` was refused as a missing key, though an
    auth scheme is case-insensitive (RFC 9110 §11.1)."""
    scheme, _, credentials = _authorization(context).partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""


def other_scheme(context: Any) -> bool:
    """Whether the call sent ``authorization`` with a scheme other than Bearer (e.g. Basic)."""
    value = _authorization(context)
    return bool(value) and value.partition(" ")[0].lower() != "bearer"


def _authorization(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return ""
