"""TLS on the gateway's client-facing endpoints (security review: no TLS anywhere): the real
``Gateway`` (gRPC server and the OpenAI-compatible HTTP API) on 127.0.0.1, in-process and
without Ray (as tests/test_gateway_restart_start.py runs it), with a throwaway CA and
certificates made in the test (tests/tls_certs.py).

Before, the gateway listened with ``add_insecure_port`` and plain HTTP: every API key crossed
the network in cleartext, and a client that insisted on TLS could not connect at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.chaos_stack import tiny_checkpoint
from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from services import gateway_server, tls
from services.tls import ClientTls, ServerTls, open_aio_channel
from tests.gateway_harness import LocalActor
from tests.test_gateway_restart_start import free_port, is_free, nodes, scheduler
from tests.tls_certs import TlsMaterial, issue, make_ca, make_tls_material
from workloads.deepresearch.grpc_client import GrpcInferenceClient
from workloads.deepresearch.openai_client import OpenAIInferenceClient

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return make_tls_material(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ClientTls]:
    """Another CA (which the gateway does not know) and a client certificate it signed."""
    directory = tmp_path_factory.mktemp("other")
    ca, key = make_ca(directory, "other")
    pair = issue(directory, "stranger", key, "other", server=False)
    return ca, ClientTls("", str(pair.cert), str(pair.key))


@asynccontextmanager
async def serving(tmp_path: Path, server_tls: ServerTls | None, host: str = "127.0.0.1",
                  http: bool = True) -> AsyncIterator[tuple[gateway_server.Gateway, int, str]]:
    """A started gateway: (it, its gRPC port, the admin key)."""
    async with scheduler(tmp_path) as sched:
        admin_key = sched.store.ensure_admin_key()
        gw = gateway_server.Gateway(LocalActor(sched), nodes(), str(tiny_checkpoint()),
                                    http_port=0 if http else None, tls=server_tls)
        port = await gw.start(host, 0)
        try:
            yield gw, port, admin_key
        finally:
            await gw.stop(0)


async def health(port: int, client: ClientTls | None) -> int:
    """The gateway's overall health status over a channel secure with ``client`` (None: plaintext)."""
    async with open_aio_channel(f"127.0.0.1:{port}", client) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def refused(port: int, client: ClientTls | None) -> grpc.StatusCode:
    """The status a health check ends with (it must fail)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health(port, client)
    return err.value.code()


async def https_health(address: str, client: ClientTls | None, scheme: str = "https") -> int:
    verify = client.ssl_context() if client is not None else False
    async with httpx2.AsyncClient(verify=verify, timeout=5) as http:
        return (await http.get(f"{scheme}://{address}/health")).status_code


def test_tls_gateway_serves_a_client_that_trusts_its_ca_and_refuses_plaintext_and_other_cas(
        tmp_path: Path, certs: TlsMaterial, stranger: tuple[Path, ClientTls]) -> None:
    """gRPC: a channel verifying with the gateway's CA is served (a health check, and a
    ListTenants call carrying the admin key); a plaintext channel and one trusting another CA
    are refused (UNAVAILABLE: no connection). HTTP: https verified with the CA answers /health;
    plain http and https trusting another CA get no answer."""
    right, wrong = ClientTls(str(certs.ca)), ClientTls(str(stranger[0]))

    async def go() -> None:
        async with serving(tmp_path, ServerTls(str(certs.server.cert), str(certs.server.key))) as (gw, port, key):
            assert await health(port, right) == health_pb2.HealthCheckResponse.SERVING
            async with open_aio_channel(f"127.0.0.1:{port}", right) as channel:
                listed = await tenant_pb2_grpc.TenantServiceStub(channel).ListTenants(
                    tenant_pb2.ListTenantsRequest(), metadata=(("authorization", f"Bearer {key}"),), timeout=5)
            assert list(listed.tenants) == []
            assert await refused(port, None) == grpc.StatusCode.UNAVAILABLE
            assert await refused(port, wrong) == grpc.StatusCode.UNAVAILABLE

            assert await https_health(gw.http_address(), right) == 200
            with pytest.raises(httpx2.TransportError):
                await https_health(gw.http_address(), None, scheme="http")
            with pytest.raises(httpx2.ConnectError):  # certificate verify failed
                await https_health(gw.http_address(), wrong)

    asyncio.run(go())


def test_mutual_tls_gateway_refuses_a_client_without_a_certificate_of_its_ca(
        tmp_path: Path, certs: TlsMaterial, stranger: tuple[Path, ClientTls]) -> None:
    """With ``tls_client_ca_file``: a client presenting a certificate signed by that CA is
    served on both APIs; one with no certificate, or one signed by another CA, is refused."""
    server = ServerTls(str(certs.server.cert), str(certs.server.key), str(certs.ca))
    anonymous = ClientTls(str(certs.ca))
    member = ClientTls(str(certs.ca), str(certs.client.cert), str(certs.client.key))
    outsider = ClientTls(str(certs.ca), stranger[1].cert_file, stranger[1].key_file)

    async def go() -> None:
        async with serving(tmp_path, server) as (gw, port, _):
            assert await health(port, member) == health_pb2.HealthCheckResponse.SERVING
            assert await refused(port, anonymous) == grpc.StatusCode.UNAVAILABLE
            assert await refused(port, outsider) == grpc.StatusCode.UNAVAILABLE

            assert await https_health(gw.http_address(), member) == 200
            for client in (anonymous, outsider):
                with pytest.raises(httpx2.TransportError):  # the handshake fails or the server hangs up
                    await https_health(gw.http_address(), client)

    asyncio.run(go())


def test_a_bad_tls_file_fails_the_start_naming_it_with_nothing_bound(tmp_path: Path, certs: TlsMaterial) -> None:
    """A key that is not the certificate's (the files changed after the config was checked):
    ``start`` raises ValueError naming the key file before it binds anything (a restarted
    gateway then retries, and exits for Ray, as for any failed start)."""
    grpc_port = free_port()

    async def go() -> None:
        async with scheduler(tmp_path) as sched:
            gw = gateway_server.Gateway(LocalActor(sched), nodes(), str(tiny_checkpoint()), http_port=0,
                                        tls=ServerTls(str(certs.server.cert), str(certs.client.key)))
            with pytest.raises(ValueError, match=f"tls_key_file {certs.client.key}: not the unencrypted PEM"):
                await gw.start("127.0.0.1", grpc_port)
            assert (gw.server, gw.http) == (None, None)
            assert is_free(grpc_port)

    asyncio.run(go())


def test_a_gateway_beyond_loopback_without_tls_warns_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A gateway on 0.0.0.0 without TLS serves, and logs one WARNING (not one per start: a
    restarted gateway retries its start up to 20 times) that API keys cross the network in
    cleartext; on loopback, or with TLS, it says nothing."""
    monkeypatch.setattr(tls, "_warned", set())

    async def go() -> None:
        for host in ("127.0.0.1", "0.0.0.0", "0.0.0.0"):
            async with serving(tmp_path / host, None, host=host, http=False) as (_, port, _key):
                assert await health(port, None) == health_pb2.HealthCheckResponse.SERVING

    with caplog.at_level(logging.WARNING, logger="services.tls"):
        asyncio.run(go())
    warnings = [r.getMessage() for r in caplog.records if r.name == "services.tls"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("the gateway's gRPC and OpenAI-compatible APIs listen on 0.0.0.0 without TLS")
    assert "cleartext" in warnings[0]


def test_the_workload_clients_reach_a_tls_gateway(tmp_path: Path, certs: TlsMaterial) -> None:
    """The DeepResearch workload's clients (gRPC, and the openai package over https) given the
    CA: the gateway answers their calls (an unknown key: UNAUTHENTICATED); without it they get
    no connection (UNAVAILABLE), as every client did before."""
    right = ClientTls(str(certs.ca))
    call = {"session_id": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "temperature": 0.0, "request_id": "r1", "api_key": "sk-nobody"}

    async def status(client: GrpcInferenceClient | OpenAIInferenceClient) -> str:
        try:
            return (await client.generate(**call)).status
        finally:
            await client.close()

    async def go() -> None:
        async with serving(tmp_path, ServerTls(str(certs.server.cert), str(certs.server.key))) as (gw, port, _):
            target, url = f"127.0.0.1:{port}", f"https://{gw.http_address()}/v1"
            assert await status(GrpcInferenceClient(target, timeout_s=5, tls=right)) == "UNAUTHENTICATED"
            assert await status(GrpcInferenceClient(target, timeout_s=5)) == "UNAVAILABLE"
            assert await status(OpenAIInferenceClient(url, model="tiny", timeout_s=5, tls=right)) == "UNAUTHENTICATED"
            assert await status(OpenAIInferenceClient(url, model="tiny", timeout_s=5)) == "UNAVAILABLE"

    asyncio.run(go())
