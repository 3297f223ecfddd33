"""Option bounds and checks shared by the commands."""

from __future__ import annotations

import math

import typer

MAX_UINT32, MAX_UINT64 = 2**32 - 1, 2**64 - 1


def finite(value: float | None) -> float | None:
    """Typer callback: refuse nan and infinities (FloatRange lets nan through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def positive(value: float) -> float:
    """Typer callback: a finite number > 0."""
    if not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} is not a finite number > 0")
    return value


GatewayOpt = typer.Option(
    None, "--gateway", metavar="HOST:PORT",
    help="the gateway to call (default: $KVSTRATA_GATEWAY, else the address `kvstrata up` saved)")
TenantNameArg = typer.Argument(..., metavar="NAME", help="the tenant's name (as given to `kvstrata tenant add`)")
