"""The ``kvstrata`` app: the commands of ``cli.lifecycle`` and ``cli.generate``, and the
``tenant``, ``admin`` and ``run`` groups (``python -m cli.main`` runs it)."""

from __future__ import annotations

import typer

from cli.admin import admin_app
from cli.generate import generate
from cli.lifecycle import down, status, up
from cli.run import run_app
from cli.tenant import tenant_app

app = typer.Typer(help="kvstrata: multi-tenant tiered KV-cache serving on Ray", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
app.add_typer(admin_app, name="admin")
app.add_typer(run_app, name="run")
for command in (up, down, status, generate):
    app.command()(command)


if __name__ == "__main__":
    app()
