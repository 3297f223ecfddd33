"""A TLS gateway bound on a wildcard address (``gateway_host: 0.0.0.0``) and a certificate that
names only ``localhost``: ``kvstrata up`` saves an address a client can dial (127.0.0.1, not
0.0.0.0), and the CLI and kvstrata's own clients verify the certificate for ``tls_server_name``.

Regression (a wildcard gateway_host with TLS): ``up`` saved ``0.0.0.0:port`` (and the OpenAI
API's ``0.0.0.0:port``), and every later command verified the gateway's certificate against
``0.0.0.0``, which no certificate names: each failed UNAVAILABLE. A certificate for a DNS name
could not be used by the CLI at all (no way to say which name to verify).

The real ``Gateway`` without Ray on 0.0.0.0 (tests/test_tls_gateway.py's ``serving``), the real
CLI via typer's CliRunner (in a thread: the gateway serves on this thread's loop), a throwaway
CA (tests/tls_certs.py).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pydantic
import pytest
from typer.testing import CliRunner

from cli import main as cli
from cli import state as cli_state
from cli.lifecycle import gateway_state, up_summary
from services.config import ServiceConfig
from services.launcher import Services
from services.tls import ClientTls, ServerTls, dial_address
from tenants.keys import write_key_file
from tests.test_tls_gateway import serving
from tests.tls_certs import Pair, TlsMaterial, issue, make_ca, make_tls_material
from workloads.deepresearch.grpc_client import GrpcInferenceClient
from workloads.deepresearch.openai_client import OpenAIInferenceClient

pytestmark = pytest.mark.timeout(120)

CALL = {"session_id": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "temperature": 0.0, "request_id": "r1", "api_key": "sk-nobody"}


@pytest.fixture(scope="module")
def local_only(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Pair]:
    """A CA and a server certificate it signed for ``localhost`` only (no IP address)."""
    directory = tmp_path_factory.mktemp("tls")
    ca, key = make_ca(directory)
    return ca, issue(directory, "localhost-only", key, "ca", server=True, names=("localhost",))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli_state, "STATE_DIR", tmp_path)
    for name in ("KVSTRATA_ADMIN_KEY", "KVSTRATA_GATEWAY", "KVSTRATA_TLS_CA", "KVSTRATA_TLS_CERT",
                 "KVSTRATA_TLS_KEY", "KVSTRATA_TLS_SERVER_NAME", "KVSTRATA_OPENAI_URL"):
        monkeypatch.delenv(name, raising=False)


def config(tmp_path: Path, ca: Path, pair: Pair, **settings: object) -> ServiceConfig:
    return ServiceConfig(state_dir=str(tmp_path / "state"), gateway_host="0.0.0.0", tls_cert_file=str(pair.cert),
                         tls_key_file=str(pair.key), tls_ca_file=str(ca), **settings)


async def run(*args: str, **env: str) -> tuple[int, str]:
    """The CLI, in a thread (its blocking gRPC calls must not stop this loop's gateway)."""
    def invoke() -> tuple[int, str]:
        result = CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "1000", "TERMINAL_WIDTH": "1000", **env})
        return result.exit_code, result.output
    return await asyncio.to_thread(invoke)


async def status(client: GrpcInferenceClient | OpenAIInferenceClient) -> str:
    try:
        return (await client.generate(**CALL)).status
    finally:
        await client.close()


def test_up_on_a_wildcard_host_saves_a_dialable_address_that_the_cli_verifies_by_name(
        tmp_path: Path, local_only: tuple[Path, Pair]) -> None:
    """Gateway on 0.0.0.0, certificate for localhost only, ``tls_server_name: localhost``: what
    ``up`` saves (``Services`` addresses, ``gateway_state``) is 127.0.0.1:port for both APIs,
    and ``tenant list`` over it succeeds with nothing on the command line; the OpenAI URL is
    https://127.0.0.1:port/v1. Saved without the name, the certificate does not match the host
    dialed and the command fails UNAVAILABLE (what every command did before, against 0.0.0.0)."""
    ca, pair = local_only
    cfg = config(tmp_path, ca, pair, tls_server_name="localhost")

    async def go() -> None:
        async with serving(tmp_path, ServerTls(str(pair.cert), str(pair.key)), host="0.0.0.0") as (gw, port, key):
            http_port = int(gw.http_address().rsplit(":", 1)[1])
            assert gw.http_address() == f"0.0.0.0:{http_port}"
            services = Services(None, {}, None, port, key, cfg, http_address=gw.http_address())
            assert (services.address, services.http_address) == (f"127.0.0.1:{port}", f"127.0.0.1:{http_port}")
            saved = gateway_state(cfg, services.address, services.http_address)
            write_key_file(tmp_path / "admin_key", key)
            (tmp_path / "gateway.json").write_text(json.dumps({**saved, "state_dir": str(tmp_path)}))

            code, output = await run("tenant", "add", "ann")
            assert code == 0, output
            code, output = await run("tenant", "list")
            assert code == 0 and "ann" in output, output
            assert cli_state.openai_api_url("") == f"https://127.0.0.1:{http_port}/v1"
            assert cli_state.client_tls(services.address) == ClientTls(str(ca), server_name="localhost")

            (tmp_path / "gateway.json").write_text(json.dumps({**saved, "state_dir": str(tmp_path),
                                                               "tls_server_name": ""}))
            code, output = await run("tenant", "list")
            assert code == 1 and output.startswith("UNAVAILABLE: "), output

    asyncio.run(go())


def test_the_workload_clients_verify_tls_server_name(tmp_path: Path, local_only: tuple[Path, Pair]) -> None:
    """gRPC (``grpc.ssl_target_name_override``) and the openai package over https (httpx'
    ``sni_hostname``) dial 127.0.0.1 and verify ``localhost`` with ``ClientTls.of_config``: the
    gateway answers (an unknown key: UNAUTHENTICATED). Without the name: no connection."""
    ca, pair = local_only
    named = ClientTls.of_config(config(tmp_path, ca, pair, tls_server_name="localhost"))
    unnamed = ClientTls.of_config(config(tmp_path, ca, pair))
    assert named == ClientTls(str(ca), server_name="localhost") and unnamed == ClientTls(str(ca))

    async def go() -> None:
        async with serving(tmp_path, ServerTls(str(pair.cert), str(pair.key)), host="0.0.0.0") as (gw, port, _):
            target, url = f"127.0.0.1:{port}", f"https://{dial_address(gw.http_address())}/v1"
            assert await status(GrpcInferenceClient(target, timeout_s=5, tls=named)) == "UNAUTHENTICATED"
            assert await status(GrpcInferenceClient(target, timeout_s=5, tls=unnamed)) == "UNAVAILABLE"
            assert await status(OpenAIInferenceClient(url, model="tiny", timeout_s=5, tls=named)) == "UNAUTHENTICATED"
            assert await status(OpenAIInferenceClient(url, model="tiny", timeout_s=5, tls=unnamed)) == "UNAVAILABLE"

    asyncio.run(go())


def test_tls_server_name_option_verifies_any_gateway(tmp_path: Path, local_only: tuple[Path, Pair]) -> None:
    """``--tls-server-name`` (or KVSTRATA_TLS_SERVER_NAME) with ``--tls-ca`` for a gateway named by
    KVSTRATA_GATEWAY, nothing saved: served; with the CA alone the name does not match."""
    ca, pair = local_only

    async def go() -> None:
        async with serving(tmp_path, ServerTls(str(pair.cert), str(pair.key)), host="0.0.0.0") as (_, port, key):
            env = {"KVSTRATA_GATEWAY": f"127.0.0.1:{port}", "KVSTRATA_ADMIN_KEY": key}
            code, output = await run("--tls-ca", str(ca), "tenant", "list", **env)
            assert code == 1 and output.startswith("UNAVAILABLE: "), output
            code, output = await run("--tls-ca", str(ca), "--tls-server-name", "localhost", "tenant", "list", **env)
            assert code == 0, output
            code, output = await run("--tls-ca", str(ca), "tenant", "list", **env, KVSTRATA_TLS_SERVER_NAME="localhost")
            assert code == 0, output

    asyncio.run(go())


def test_dial_address_turns_a_wildcard_bind_into_loopback() -> None:
    assert dial_address("0.0.0.0:50051") == "127.0.0.1:50051"
    assert dial_address(":::8000") == "[::1]:8000"  # HttpServer.address of a "::" bind
    assert dial_address("[::]:8000") == "[::1]:8000"
    assert dial_address("::1:8000") == "[::1]:8000"
    assert dial_address("10.0.0.7:50051") == "10.0.0.7:50051"
    assert dial_address("gw.example.com:443") == "gw.example.com:443"
    assert dial_address("") == ""


def test_tls_server_name_is_a_host_name_or_address(tmp_path: Path) -> None:
    for name, kept in (("localhost", "localhost"), ("gw.example.com", "gw.example.com"), ("10.0.0.7", "10.0.0.7"),
                       ("[::1]", "::1"), ("", "")):
        assert ServiceConfig(state_dir=str(tmp_path), tls_server_name=name).tls_server_name == kept
    for bad in ("https://gw.example.com", "gw.example.com:443", "gw example", "gw/x", "a..b"):
        with pytest.raises(pydantic.ValidationError, match=re.escape(f"tls_server_name {bad!r}: not a host name")):
            ServiceConfig(state_dir=str(tmp_path), tls_server_name=bad)


def test_up_summary_names_the_certificate_name(tmp_path: Path) -> None:
    certs: TlsMaterial = make_tls_material(tmp_path / "tls")
    cfg = ServiceConfig(state_dir=str(tmp_path), gateway_host="0.0.0.0", tls_cert_file=str(certs.server.cert),
                        tls_key_file=str(certs.server.key), tls_server_name="localhost")
    lines = [re.sub(r"\[/?bold\]", "", line) for line in up_summary(cfg, "127.0.0.1:1", "127.0.0.1:2", {}, None)]
    assert lines[:2] == ["gateway: 127.0.0.1:1 (TLS, certificate name localhost)",
                         "OpenAI-compatible API: https://127.0.0.1:2/v1"]


def test_a_wildcard_bind_on_another_machine_is_dialled_at_its_node() -> None:
    """Regression: on a joined cluster whose gateway Ray placed on another machine, the saved
    address of a wildcard bind was loopback (before, ``0.0.0.0``): this machine, not the
    gateway's. ``start_services`` passes the gateway's node address when it is not the driver's."""
    assert dial_address("0.0.0.0:50051", "10.0.0.9") == "10.0.0.9:50051"
    assert dial_address(":::8000", "fd00::9") == "[fd00::9]:8000"
    assert dial_address("10.0.0.7:50051", "10.0.0.9") == "10.0.0.7:50051"  # a named bind stays
    cfg = ServiceConfig(gateway_host="0.0.0.0", gateway_port=0)
    services = Services(None, {}, None, 50051, "", cfg, http_address="0.0.0.0:8000", gateway_ip="10.0.0.9")
    assert (services.address, services.http_address) == ("10.0.0.9:50051", "10.0.0.9:8000")
    here = Services(None, {}, None, 50051, "", cfg, http_address="0.0.0.0:8000")
    assert (here.address, here.http_address) == ("127.0.0.1:50051", "127.0.0.1:8000")
