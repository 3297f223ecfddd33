"""The CLI's console, its exit codes, and how a failed gRPC call ends a command.

Exit codes (``kvstrata --help`` lists them):

===  ==========================================================================
0    the command did what it was asked
1    the command failed: the server refused the call (any gRPC status: UNAUTHENTICATED,
     RESOURCE_EXHAUSTED, NOT_FOUND, ALREADY_EXISTS, INVALID_ARGUMENT, UNAVAILABLE, ...), or
     there is nothing to talk to (no gateway up, no admin key), or starting/stopping failed
2    a usage error, as click reports it: an unknown command or option, a missing argument,
     an option value out of range (``--config`` naming a bad file included)
130  cancelled with Ctrl-C (128 + SIGINT, as a shell reports it)
===  ==========================================================================
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import NoReturn

import grpc
import typer
from rich.console import Console
from rich.markup import escape

console = Console(width=None if sys.stdout.isatty() else 160)  # piped: keep tables readable

EXIT_FAILED = 1
"""The command failed (the server refused it, or nothing answered): not a usage error."""

EXIT_USAGE = 2
"""A usage error (click's own exit code for one)."""

CANCELLED_EXIT_CODE = 130
"""Exit code after Ctrl-C (128 + SIGINT, as a shell reports it)."""

EXIT_CODES_HELP = ("Exit codes: 0 done; 1 failed (the server refused the call, e.g. UNAUTHENTICATED, "
                   "RESOURCE_EXHAUSTED, NOT_FOUND, ALREADY_EXISTS, INVALID_ARGUMENT, or aborted an answer, or "
                   "nothing answered); "
                   "2 usage error (a bad command, option or value); 130 cancelled with Ctrl-C.")
"""The exit codes as one paragraph of ``kvstrata --help``."""


def say(text: str) -> None:
    """Print one line that must stay whole (an address, a path, a command): never wrapped,
    however narrow the terminal, so it can be copied as it is."""
    console.print(text, soft_wrap=True)


def die(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print ``message`` in red (one unwrapped line; not markup) and exit ``code``
    (``EXIT_FAILED``, or ``EXIT_USAGE`` for options that make no sense together)."""
    console.print(f"[red]{escape(message)}[/red]", soft_wrap=True)
    raise typer.Exit(code)


TLS_HINT = ("; if the gateway serves TLS, give its CA (kvstrata --tls-ca CA.pem, or --tls for the system's "
            "roots), and if it requires client certificates, --tls-cert and --tls-key")
"""Appended to an UNAVAILABLE whose connection was closed or refused during the TLS handshake.
Regression (fresh-user trial 24): a call without the CA, or without a client certificate to a
gateway that requires one, said only "Socket closed"."""
_HANDSHAKE_FAILURE = re.compile(r"Socket closed|handshake|SSL|certificate|Connection reset", re.IGNORECASE)


def fail(err: grpc.RpcError, reword: Callable[[str], str] | None = None) -> NoReturn:
    """Print a failed call as one line, ``CODE: details``, and exit ``EXIT_FAILED`` whatever
    the status: the server refused or failed it (a usage error never reaches the server). An
    UNAVAILABLE that reads as a failed TLS handshake says which options fix it (``TLS_HINT``).
    ``reword``: applied to the details' line (``generate`` names the option that gave a
    message the server refused, ``cli.messages.ChatSources``)."""
    details = (err.details() or "").splitlines()
    line = details[0] if details else ""
    if reword is not None:
        line = reword(line)
    if err.code() == grpc.StatusCode.UNAVAILABLE and _HANDSHAKE_FAILURE.search(line):
        line += TLS_HINT
    console.print(f"[red]{err.code().name}[/red]: {escape(line)}", soft_wrap=True)
    raise typer.Exit(EXIT_FAILED)
