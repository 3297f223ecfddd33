"""``kvstrata tenant show`` / ``rotate-key`` with ``KVSTRATA_API_KEY`` exported name the key they sent.

Regression (s41 new-user walkthrough): the README's walkthrough exports ``KVSTRATA_API_KEY``
(alice's key) for ``generate``; ``tenant list`` and ``tenant update`` in that shell act with
the admin key, but ``tenant show bob`` sent alice's key and said only "PERMISSION_DENIED: a
tenant key reaches only its own tenant", not that the environment's key was sent nor how to act
as the admin. A real gateway (``tests.gateway_harness``: TenantService, scheduler, SQLite store).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import main as cli
from tenants.model import TenantSpec
from tests.gateway_harness import serve


@pytest.mark.parametrize("command", [["tenant", "show", "bob"], ["tenant", "rotate-key", "bob"]])
def test_another_tenants_refusal_names_the_environments_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            command: list[str]) -> None:
    """alice's key for bob: exit 1, the server's words, then which key the CLI sent and how to
    act as the admin; the same command with alice's own name answers."""
    monkeypatch.delenv("KVSTRATA_ADMIN_KEY", raising=False)
    with serve(tmp_path) as gw:
        _alice, alice_key = asyncio.run_coroutine_threadsafe(gw.scheduler.register_tenant(TenantSpec("alice")),
                                                             gw.loop).result(30)
        asyncio.run_coroutine_threadsafe(gw.scheduler.register_tenant(TenantSpec("bob")), gw.loop).result(30)
        env = {"KVSTRATA_API_KEY": alice_key, "COLUMNS": "1000"}
        refused = CliRunner().invoke(cli.app, [*command, "--gateway", gw.address], env=env)
        own = CliRunner().invoke(cli.app, ["tenant", "show", "alice", "--gateway", gw.address], env=env)
    assert refused.exit_code == 1, refused.output
    line = " ".join(refused.output.split())
    assert line.startswith("PERMISSION_DENIED: a tenant key reaches only its own tenant"), line
    assert "the CLI sent the tenant key of --api-key / KVSTRATA_API_KEY; unset KVSTRATA_API_KEY" in line, line
    assert own.exit_code == 0 and "alice" in own.output, own.output
