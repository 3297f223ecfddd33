"""Key rotation over gRPC and from the CLI (issue 18 fault 7: `kvstrata admin rotate-key`).

Real gRPC server (tests.gateway_harness), real tenant store on disk, the real CLI via
typer's CliRunner.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from cli import main as cli
from cli import state as cli_state
from kvstrata.v1 import admin_pb2, admin_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from tenants.keys import KEY_PATTERN, read_key_file, write_key_file
from tenants.model import TenantSpec
from tests.gateway_harness import serve
from tests.test_auth_flood import _Ctx


def _md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture
def gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cli_state, "STATE_DIR", tmp_path)
    monkeypatch.delenv("KVSTRATA_ADMIN_KEY", raising=False)
    with serve(tmp_path) as gw:
        write_key_file(tmp_path / "admin_key", gw.admin_key)
        # what `kvstrata up` saves: the deployment whose key file this is
        (tmp_path / "gateway.json").write_text(json.dumps({"address": gw.address, "state_dir": str(tmp_path)}))
        yield gw


def test_rotate_admin_key_rpc(gateway) -> None:
    """issue 18 fault 7: the admin key can be rotated; the old one stops at once."""
    with grpc.insecure_channel(gateway.address) as ch:
        admin = admin_pb2_grpc.AdminServiceStub(ch)
        new = admin.RotateAdminKey(admin_pb2.RotateAdminKeyRequest(), metadata=_md(gateway.admin_key)).api_key

        assert KEY_PATTERN.fullmatch(new) and new != gateway.admin_key
        with pytest.raises(grpc.RpcError) as err:
            admin.RotateAdminKey(admin_pb2.RotateAdminKeyRequest(), metadata=_md(gateway.admin_key))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert gateway.scheduler.store.verify_admin_key(new) is True


def test_rotate_tenant_key_rpc_by_admin_self_and_other(gateway) -> None:
    """issue 18 fault 7: TenantService.RotateKey for the admin or the tenant itself only."""
    store = gateway.scheduler.store
    ann, ann_key = store.register(TenantSpec("ann"))
    _, bob_key = store.register(TenantSpec("bob"))
    with grpc.insecure_channel(gateway.address) as ch:
        tenants = tenant_pb2_grpc.TenantServiceStub(ch)
        by_admin = tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), metadata=_md(gateway.admin_key)).api_key
        by_self = tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), metadata=_md(by_admin)).api_key
        with pytest.raises(grpc.RpcError) as other:
            tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), metadata=_md(bob_key))
        with pytest.raises(grpc.RpcError) as missing:
            tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="nobody"), metadata=_md(gateway.admin_key))
        with pytest.raises(grpc.RpcError) as stale:
            tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), metadata=_md(ann_key))

    assert other.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert stale.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [store.authenticate(k) for k in (ann_key, by_admin, by_self)] == [None, None, ann]


def test_cli_admin_rotate_key_over_grpc_writes_the_key_file(gateway, tmp_path: Path) -> None:
    """issue 18 fault 7: `kvstrata admin rotate-key` rotates and saves the new key atomically."""
    result = CliRunner().invoke(cli.app, ["admin", "rotate-key", "--gateway", gateway.address])

    assert result.exit_code == 0, result.output
    new = read_key_file(tmp_path / "admin_key")
    assert new is not None and new != gateway.admin_key
    assert gateway.scheduler.store.verify_admin_key(new) is True
    assert gateway.scheduler.store.verify_admin_key(gateway.admin_key) is False


def test_the_saved_admin_key_goes_only_to_its_own_deployment(gateway, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review 23d, B): the saved deployment's admin key went, in the clear, to
    whatever --gateway named, and `admin rotate-key` against another deployment (its key in
    KVSTRATA_ADMIN_KEY) wrote that deployment's new key over this one's only key file. Now a
    call to another gateway without KVSTRATA_ADMIN_KEY exits 1 before anything is sent, and a
    rotation with KVSTRATA_ADMIN_KEY prints the new key and leaves the saved file alone."""
    import socket

    with socket.socket() as other:  # a listener that records whether anything was sent
        other.bind(("127.0.0.1", 0))
        other.listen()
        other.settimeout(0.5)
        address = f"127.0.0.1:{other.getsockname()[1]}"
        result = CliRunner().invoke(cli.app, ["tenant", "list", "--gateway", address])
        with pytest.raises(TimeoutError):
            other.accept()
    assert result.exit_code == 1 and f"no admin key for {address}" in result.output, result.output

    saved = read_key_file(tmp_path / "admin_key")
    monkeypatch.setenv("KVSTRATA_ADMIN_KEY", gateway.admin_key)  # as another deployment's operator
    result = CliRunner().invoke(cli.app, ["admin", "rotate-key", "--gateway", gateway.address])
    assert result.exit_code == 0, result.output
    [new] = re.findall(r"kvs_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", result.output)
    assert gateway.scheduler.store.verify_admin_key(new) is True
    assert read_key_file(tmp_path / "admin_key") == saved  # overwritten before


def test_cli_admin_rotate_key_local_when_the_key_is_lost(gateway, tmp_path: Path) -> None:
    """issue 18 fault 7: with the key file gone, `--local` rotates in the tenant database."""
    (tmp_path / "admin_key").unlink()

    result = CliRunner().invoke(cli.app, ["admin", "rotate-key", "--local"])

    assert result.exit_code == 0, result.output
    new = read_key_file(tmp_path / "admin_key")
    assert new is not None and gateway.scheduler.store.verify_admin_key(new) is True
    with grpc.insecure_channel(gateway.address) as ch:  # the running gateway accepts it
        admin_pb2_grpc.AdminServiceStub(ch).RotateAdminKey(admin_pb2.RotateAdminKeyRequest(), metadata=_md(new))


def test_cli_tenant_rotate_key(gateway) -> None:
    """issue 18 fault 7: `kvstrata tenant rotate-key NAME` prints the new key once."""
    ann, old = gateway.scheduler.store.register(TenantSpec("ann"))

    result = CliRunner().invoke(cli.app, ["tenant", "rotate-key", "ann", "--gateway", gateway.address])

    assert result.exit_code == 0, result.output
    keys = re.findall(r"kvs_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", result.output)
    assert len(keys) == 1
    assert gateway.scheduler.store.authenticate(keys[0]) == ann
    assert gateway.scheduler.store.authenticate(old) is None


def test_a_tenant_reads_its_own_settings_and_usage_and_no_one_elses(gateway) -> None:
    """A fresh-user trial: a tenant could not see its own usage (GetUsage and GetTenant took
    the admin key only). Now its own key reads its own; another tenant's key is
    PERMISSION_DENIED, and an unknown key UNAUTHENTICATED."""
    store = gateway.scheduler.store
    store.register(TenantSpec("cid", ttft_slo_ms=700.0))
    _, cid_key = store.register(TenantSpec("cid2"))
    _, dot_key = store.register(TenantSpec("dot"))
    with grpc.insecure_channel(gateway.address) as ch:
        tenants = tenant_pb2_grpc.TenantServiceStub(ch)
        own = tenants.GetTenant(tenant_pb2.GetTenantRequest(name="cid2"), metadata=_md(cid_key)).tenant
        usage = tenants.GetUsage(tenant_pb2.GetUsageRequest(name="cid2"), metadata=_md(cid_key)).usage
        assert own.spec.name == "cid2" and usage.tenant_id == own.tenant_id and usage.requests == 0
        for call, req in ((tenants.GetTenant, tenant_pb2.GetTenantRequest(name="cid")),
                          (tenants.GetUsage, tenant_pb2.GetUsageRequest(name="cid"))):
            with pytest.raises(grpc.RpcError) as other:
                call(req, metadata=_md(dot_key))
            assert other.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as nobody:
                call(req, metadata=_md("ks-not-a-key"))
            assert nobody.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert tenants.GetTenant(tenant_pb2.GetTenantRequest(name="cid"),
                                 metadata=_md(gateway.admin_key)).tenant.spec.ttft_slo_ms == 700.0


def _wrong_secret(api_key: str) -> str:
    return api_key[: len("kvs_0123456789ab_")] + secrets.token_urlsafe(32)


def test_rotating_a_key_never_unprotects_another_tenants_key(gateway) -> None:
    """Regression (secrev16 fault B): a tenant sent wrong secrets for another tenant's key id
    from their shared address, then rotated its own key; the gateway's whole auth cache was
    dropped (``Authenticator.forget``) and the victim's correct key got RESOURCE_EXHAUSTED."""
    store = gateway.scheduler.store
    _, victim = store.register(TenantSpec("victim"))
    _, attacker = store.register(TenantSpec("attacker"))
    with grpc.insecure_channel(gateway.address) as ch:
        tenants = tenant_pb2_grpc.TenantServiceStub(ch)

        def usage(key: str) -> grpc.StatusCode:
            try:
                tenants.GetUsage(tenant_pb2.GetUsageRequest(name="victim"), metadata=_md(key))
            except grpc.RpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        first = usage(victim)
        flood = [usage(_wrong_secret(victim)) for _ in range(gateway.auth.failures_per_peer_key + 1)]
        tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="attacker"), metadata=_md(attacker))
        after = [usage(victim) for _ in range(3)]

    assert first == grpc.StatusCode.OK and flood[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after == [grpc.StatusCode.OK] * 3


def test_changing_a_tenant_forgets_only_its_own_cached_keys(gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """secrev16 fault B: RotateKey, UpdateTenant and DeleteTenant of one tenant, and
    RotateAdminKey, leave every other tenant's cached key in the gateway (no new check). The
    probe is the gateway's cached key check (``Authenticator.tenant``, as inference calls make
    it): the tenant service's own calls confirm every key at the scheduler anyway
    (``Authenticator.recheck``, since the session 32 review)."""
    store = gateway.scheduler.store
    _, victim = store.register(TenantSpec("victim"))
    _, other = store.register(TenantSpec("other"))
    store.register(TenantSpec("gone"))
    checked: list[str] = []
    real = gateway.scheduler.authenticate

    async def counted(api_key: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        checked.append(api_key)
        return await real(api_key, *args, **kwargs)

    monkeypatch.setattr(gateway.scheduler, "authenticate", counted)
    with grpc.insecure_channel(gateway.address) as ch:
        tenants = tenant_pb2_grpc.TenantServiceStub(ch)
        admin = admin_pb2_grpc.AdminServiceStub(ch)
        get = lambda: asyncio.run_coroutine_threadsafe(gateway.auth.tenant(_Ctx(victim)), gateway.loop).result(10)
        get()
        other = tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="other"), metadata=_md(other)).api_key
        get()
        tenants.UpdateTenant(tenant_pb2.UpdateTenantRequest(name="other", spec=tenant_pb2.TenantSpec(ttft_slo_ms=900.0)),
                             metadata=_md(gateway.admin_key))
        tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name="gone"), metadata=_md(gateway.admin_key))
        admin.RotateAdminKey(admin_pb2.RotateAdminKeyRequest(), metadata=_md(gateway.admin_key))
        get()

    assert checked.count(victim) == 1
