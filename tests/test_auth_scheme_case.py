"""The auth scheme ``Bearer`` is case-insensitive (RFC 9110 §11.1) in both APIs, and another
scheme is a 401 / UNAUTHENTICATED that says which scheme to send.

Regression (s39): ``Authorization: bearer <key>`` (lowercase, as some HTTP clients and proxies
send it) was refused as a missing key, 401 "missing or unknown API key", over HTTP and gRPC.
Real ``HttpServer``, ``OpenAIEdge``, gateway servicers, ``Authenticator`` and
``GlobalSchedulerService``.
"""

from __future__ import annotations

import asyncio
import base64
import types
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from services.auth import Authenticator
from services.global_scheduler_admission import GlobalSchedulerService
from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.server import HttpServer
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor, serve

SCHEMES = ["Bearer", "bearer", "BEARER", "bEaReR"]


def test_the_http_api_takes_bearer_in_any_case_and_names_the_scheme_it_refuses(tmp_path: Path) -> None:
    """``GET /v1/models`` with the tenant's key after ``Bearer`` in four cases is 200 each; the
    key after ``Basic`` or ``Token``, or Basic credentials, is 401 ``invalid_api_key`` whose
    message says the scheme must be Bearer; a missing header's 401 does not say so."""

    async def run() -> None:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        _tenant, key = await scheduler.register_tenant(TenantSpec("t"))
        auth = Authenticator(LocalActor(scheduler))
        server = HttpServer(create_app(OpenAIEdge(types.SimpleNamespace(auth=auth), "m@0:f16", list,  # type: ignore[arg-type]
                                                  lambda: 1)))
        port = await server.start("127.0.0.1", 0)
        try:
            async def models(authorization: str | None) -> tuple[int, str]:
                def get() -> tuple[int, str]:
                    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
                    if authorization is not None:
                        request.add_header("Authorization", authorization)
                    try:
                        with urllib.request.urlopen(request, timeout=10) as reply:
                            return reply.status, reply.read().decode()
                    except urllib.error.HTTPError as err:
                        return err.code, err.read().decode()
                return await asyncio.to_thread(get)

            for scheme in SCHEMES:
                status, text = await models(f"{scheme} {key}")
                assert status == 200, (scheme, text)
            basic = base64.b64encode(f"t:{key}".encode()).decode()
            for other in (f"Basic {basic}", f"Token {key}", key):
                status, text = await models(other)
                assert status == 401 and "invalid_api_key" in text, other
                assert "the authorization scheme must be Bearer" in text, other
            status, text = await models(None)
            assert status == 401 and "scheme" not in text
        finally:
            await server.stop()
            scheduler.store.close()

    asyncio.run(run())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_grpc_metadata_takes_bearer_in_any_case(tmp_path: Path, scheme: str) -> None:
    """``GetTenant`` with ``authorization: <scheme> <key>`` metadata answers for the tenant's own
    key and for the admin key (both roles read the scheme the same way)."""
    with serve(tmp_path) as gw:
        _, key = gw.scheduler.store.register(TenantSpec("ann"))
        with grpc.insecure_channel(gw.address) as channel:
            tenants = tenant_pb2_grpc.TenantServiceStub(channel)
            for caller in (key, gw.admin_key):
                reply = tenants.GetTenant(tenant_pb2.GetTenantRequest(name="ann"),
                                          metadata=(("authorization", f"{scheme} {caller}"),), timeout=10)
                assert reply.tenant.spec.name == "ann"


def test_grpc_metadata_with_another_scheme_is_unauthenticated_naming_bearer(tmp_path: Path) -> None:
    """``authorization: Basic <key>`` is UNAUTHENTICATED, its details naming the scheme to send."""
    with serve(tmp_path) as gw:
        _, key = gw.scheduler.store.register(TenantSpec("ann"))
        with grpc.insecure_channel(gw.address) as channel, pytest.raises(grpc.RpcError) as refused:
            tenant_pb2_grpc.TenantServiceStub(channel).GetTenant(
                tenant_pb2.GetTenantRequest(name="ann"), metadata=(("authorization", f"Basic {key}"),), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "the authorization scheme must be Bearer" in refused.value.details()
