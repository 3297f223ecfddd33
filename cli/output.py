"""The CLI's console and how a failed gRPC call ends a command."""

from __future__ import annotations

import sys

import grpc
import typer
from rich.console import Console
from rich.markup import escape

console = Console(width=None if sys.stdout.isatty() else 160)  # piped: keep tables readable

INPUT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.ALREADY_EXISTS}
"""Statuses that mean the command's input was wrong: exit code 2 (as a usage error); others 1."""


def fail(err: grpc.RpcError) -> None:
    """Print a failed call as one line, ``CODE: details``; exit 2 for input errors, else 1."""
    details = (err.details() or "").splitlines()
    console.print(f"[red]{err.code().name}[/red]: {escape(details[0] if details else '')}", soft_wrap=True)
    raise typer.Exit(2 if err.code() in INPUT_ERRORS else 1)
