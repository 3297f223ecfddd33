"""Review 23d: ``kvstrata run deepresearch`` deleted and re-registered any tenant named like its
demo tenants on the gateway it was pointed at, taking a production tenant's key and cached KV
away. It now replaces only tenants it registered itself (it holds a working key of theirs from
an earlier run), over a real gRPC TenantService (``tests.gateway_harness``)."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import grpc
import pytest

from tenants.model import TenantSpec
from tests.gateway_harness import serve
from workloads.deepresearch.demo_config import demo_tenants
from workloads.deepresearch.register import TenantNameTaken, load_keys, register_tenants, save_keys

PROFILES = demo_tenants(0.054)[:2]  # chat, analyst


def _register(address: str, admin_key: str, **kwargs) -> dict[str, str]:  # type: ignore[no-untyped-def]
    async def go() -> dict[str, str]:
        async with grpc.aio.insecure_channel(address) as ch:
            return await register_tenants(ch, admin_key, PROFILES, **kwargs)
    return asyncio.run(go())


def test_a_tenant_the_workload_did_not_register_is_left_alone(tmp_path: Path) -> None:
    """Before: the operator's ``analyst`` was deleted and registered again with a new key."""
    with serve(tmp_path) as gw:
        _, theirs = gw.scheduler.store.register(TenantSpec("analyst", weight=3.0))
        with pytest.raises(TenantNameTaken, match="'analyst' exists") as err:
            _register(gw.address, gw.admin_key)
        assert gw.scheduler.store.authenticate(theirs).spec.weight == 3.0  # untouched, key works
        assert err.value.registered == {} and "kvstrata tenant rm analyst" in str(err.value)
        assert [t.spec.name for t in gw.scheduler.store.list()] == ["analyst"]  # nothing registered


def test_a_refused_run_changes_nothing(tmp_path: Path) -> None:
    """Fresh-user trial 24: with an earlier run's ``chat`` and the operator's ``analyst``, the
    run replaced ``chat`` (its key and usage gone), then stopped at ``analyst``. Now every
    taken name is checked first: ``chat``'s key still works."""
    with serve(tmp_path) as gw:
        first = _register(gw.address, gw.admin_key)
        gw.scheduler.store.delete("analyst")
        _, theirs = gw.scheduler.store.register(TenantSpec("analyst", weight=3.0))
        with pytest.raises(TenantNameTaken):
            _register(gw.address, gw.admin_key, earlier_keys=first)
        assert gw.scheduler.store.authenticate(first["chat"]).spec.name == "chat"  # not replaced
        assert gw.scheduler.store.authenticate(theirs).spec.weight == 3.0


def test_tenants_of_an_earlier_run_are_replaced(tmp_path: Path) -> None:
    with serve(tmp_path) as gw:
        first = _register(gw.address, gw.admin_key)
        second = _register(gw.address, gw.admin_key, earlier_keys=first)
        assert set(second) == {"chat", "analyst"} and all(second[n] != first[n] for n in second)
        assert all(gw.scheduler.store.authenticate(k) is None for k in first.values())  # old keys gone
        with pytest.raises(TenantNameTaken):  # a stale key (rotated away since) proves nothing
            _register(gw.address, gw.admin_key, earlier_keys=first)
        third = _register(gw.address, gw.admin_key, replace_any=True)  # a deployment of its own
        assert gw.scheduler.store.authenticate(third["analyst"]).spec.name == "analyst"


def test_saved_keys_merge_per_deployment_and_stay_private(tmp_path: Path) -> None:
    path = tmp_path / "cli" / "workload_keys.json"
    assert load_keys(path, "a:1") == {}
    save_keys(path, "a:1", {"chat": "k1", "analyst": "k2"})
    save_keys(path, "a:1", {"chat": "k3"})
    save_keys(path, "b:2", {"chat": "k4"})
    assert load_keys(path, "a:1") == {"chat": "k3", "analyst": "k2"} and load_keys(path, "b:2") == {"chat": "k4"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.write_text("[1, 2]")
    assert load_keys(path, "a:1") == {}


def test_the_cli_stops_at_a_foreign_tenant_and_keeps_the_keys_it_got(tmp_path: Path) -> None:
    """``kvstrata run deepresearch`` against a gateway holding the operator's ``analyst``: exit 1
    naming it, before any request and any registration; the operator's tenant keeps its key."""
    from typer.testing import CliRunner

    import cli.main as cli

    with serve(tmp_path / "gw") as gw:
        _, theirs = gw.scheduler.store.register(TenantSpec("analyst", weight=3.0))
        result = CliRunner().invoke(cli.app, ["run", "deepresearch", "--tenants", "2", "--gateway", gw.address],
                                    env={"KVSTRATA_ADMIN_KEY": gw.admin_key, "KVSTRATA_STATE_DIR": str(tmp_path / "cli"),
                                         "COLUMNS": "1000"})
        assert result.exit_code == 1, result.output
        assert "a tenant named 'analyst' exists and this workload did not register it" in result.output
        assert gw.scheduler.store.authenticate(theirs).spec.weight == 3.0
        assert load_keys(tmp_path / "cli" / "workload_keys.json", gw.address) == {}
        assert [t.spec.name for t in gw.scheduler.store.list()] == ["analyst"]  # nothing registered
