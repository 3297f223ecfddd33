"""The ``kvstrata`` app: the commands of ``cli.lifecycle`` and ``cli.generate``, and the
``tenant``, ``admin`` and ``run`` groups (``python -m cli.main`` runs it).

Help texts come from the commands' docstrings, written for the source: ``help_paragraphs``
turns each into what ``--help`` shows (typer 0.29's rich help keeps a paragraph's line breaks
after the first paragraph, and RST's double backticks would show as written).
"""

from __future__ import annotations

import inspect
import re

import typer

from cli import state
from cli.admin import admin_app
from cli.generate import close_session, generate
from cli.lifecycle import down, status, up
from cli.output import EXIT_CODES_HELP
from cli.run import run_app
from cli.tenant import tenant_app

app = typer.Typer(help="kvstrata: multi-tenant tiered KV-cache serving on Ray.\n\n" + EXIT_CODES_HELP,
                  no_args_is_help=True)


@app.callback()
def tls_options(
    tls_ca: str = typer.Option("", "--tls-ca", envvar="KVSTRATA_TLS_CA", metavar="PEM",
                               help="CA bundle that verifies the gateway's TLS certificate: the commands then "
                               "use TLS for any gateway (default: TLS with the CA of the config `kvstrata up` "
                               "ran, when it turned TLS on)"),
    tls_cert: str = typer.Option("", "--tls-cert", envvar="KVSTRATA_TLS_CERT", metavar="PEM",
                                 help="client certificate for a gateway that requires one (mutual TLS); "
                                 "with --tls-key"),
    tls_key: str = typer.Option("", "--tls-key", envvar="KVSTRATA_TLS_KEY", metavar="PEM",
                                help="the private key of --tls-cert"),
    tls_server_name: str = typer.Option("", "--tls-server-name", envvar="KVSTRATA_TLS_SERVER_NAME",
                                        metavar="NAME", help="the name the gateway's certificate must carry "
                                        "(default: the config's tls_server_name for the gateway `kvstrata up` "
                                        "started, else the host dialed); implies TLS"),
    tls: bool = typer.Option(False, "--tls", envvar="KVSTRATA_TLS",
                             help="use TLS for any gateway, verified with the system's CA roots (any other "
                             "--tls-* option implies TLS too)"),
) -> None:
    state.TLS_OPTIONS = state.TlsOptions(tls_ca, tls_cert, tls_key, tls_server_name, tls)


app.add_typer(tenant_app, name="tenant")
app.add_typer(admin_app, name="admin")
app.add_typer(run_app, name="run")
for command in (up, down, status, generate):
    app.command()(command)
app.command("close-session")(close_session)


def help_paragraphs(doc: str) -> str:
    """A docstring as ``--help`` text: dedented, each paragraph on one line (paragraphs still
    apart), ``Args:``-style sections kept out, and ``code`` written with single backticks."""
    paragraphs = [" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]
    return "\n\n".join(re.sub(r"``([^`]+)``", r"`\1`", p) for p in paragraphs)


def _clean_help(group: typer.Typer) -> None:
    """Set every command's help under ``group`` (its sub-groups too) to ``help_paragraphs`` of
    its docstring, unless the command was given a help text of its own."""
    for info in group.registered_commands:
        if info.help is None and info.callback is not None and info.callback.__doc__:
            info.help = help_paragraphs(info.callback.__doc__)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _clean_help(sub.typer_instance)


_clean_help(app)

if __name__ == "__main__":
    app()
