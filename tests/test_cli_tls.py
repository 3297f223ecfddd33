"""The CLI over TLS (security review: no TLS anywhere). ``kvstrata up`` saves whether TLS is on
(gateway.json ``tls``, ``tls_ca_file``), and later commands then open a secure channel to that
gateway with the config's CA by themselves; ``kvstrata --tls-ca`` / KVSTRATA_TLS_CA verify any
gateway, ``--tls-cert``/``--tls-key`` present a client certificate (mutual TLS). Before, every
command opened ``grpc.insecure_channel``: against a TLS gateway it failed (UNAVAILABLE), and
against a plaintext one every key crossed the network in cleartext.

Real gRPC server with TLS (tests.gateway_harness), the real CLI via typer's CliRunner, a
throwaway CA (tests/tls_certs.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from cli import main as cli
from cli import state as cli_state
from cli.lifecycle import up_summary
from services.config import ServiceConfig
from services.tls import ServerTls
from tenants.keys import write_key_file
from tenants.model import TenantSpec
from tests.gateway_harness import Gateway, serve
from tests.tls_certs import TlsMaterial, make_tls_material

ANSI_MARKUP = re.compile(r"\[/?(bold|yellow|red)\]")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return make_tls_material(tmp_path_factory.mktemp("tls"))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli_state, "STATE_DIR", tmp_path)
    for name in ("KVSTRATA_ADMIN_KEY", "KVSTRATA_GATEWAY", "KVSTRATA_TLS_CA", "KVSTRATA_TLS_CERT",
                 "KVSTRATA_TLS_KEY", "KVSTRATA_OPENAI_URL", "KVSTRATA_TLS_SERVER_NAME", "KVSTRATA_TLS"):
        monkeypatch.delenv(name, raising=False)


def tls_gateway(state_dir: Path, certs: TlsMaterial, mutual: bool = False) -> Iterator[Gateway]:
    server = ServerTls(str(certs.server.cert), str(certs.server.key), str(certs.ca) if mutual else "")
    with serve(state_dir, credentials=server.grpc_credentials()) as gw:
        yield gw


@pytest.fixture
def gateway(tmp_path: Path, certs: TlsMaterial) -> Iterator[Gateway]:
    yield from tls_gateway(tmp_path, certs)


@pytest.fixture
def mutual_gateway(tmp_path: Path, certs: TlsMaterial) -> Iterator[Gateway]:
    yield from tls_gateway(tmp_path, certs, mutual=True)


def save_up_state(state_dir: Path, gw: Gateway, **tls: object) -> None:
    """What ``kvstrata up`` saves (its admin key file, gateway.json), with ``tls`` added."""
    write_key_file(state_dir / "admin_key", gw.admin_key)
    (state_dir / "gateway.json").write_text(json.dumps({"address": gw.address, "state_dir": str(state_dir),
                                                        "http_address": "127.0.0.1:8443", **tls}))


def run(*args: str, **env: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "1000", "TERMINAL_WIDTH": "1000", **env})
    return result.exit_code, result.output


def test_commands_use_tls_to_the_gateway_up_saved_with_tls(gateway: Gateway, certs: TlsMaterial,
                                                           tmp_path: Path) -> None:
    """After an `up` with TLS on, `tenant add` and `tenant list` reach the gateway with the
    saved CA and nothing on the command line. The same state without `tls` (what the CLI
    did before: a plaintext channel) is refused by the TLS gateway."""
    save_up_state(tmp_path, gateway, tls=True, tls_ca_file=str(certs.ca))
    code, output = run("tenant", "add", "ann")
    assert code == 0, output
    code, output = run("tenant", "list")
    assert code == 0 and "ann" in output, output
    assert cli_state.openai_api_url("") == "https://127.0.0.1:8443/v1"

    save_up_state(tmp_path, gateway)  # an `up` without TLS: plaintext
    code, output = run("tenant", "list")
    assert code == 1 and output.startswith("UNAVAILABLE: "), output
    assert cli_state.openai_api_url("") == "http://127.0.0.1:8443/v1"


def test_tls_ca_option_and_environment_verify_any_gateway(gateway: Gateway, certs: TlsMaterial) -> None:
    """A gateway named by KVSTRATA_GATEWAY, nothing saved: plaintext by default (refused by a
    TLS gateway), TLS with --tls-ca or KVSTRATA_TLS_CA; a CA file that cannot be read is
    named (exit 1)."""
    env = {"KVSTRATA_GATEWAY": gateway.address, "KVSTRATA_ADMIN_KEY": gateway.admin_key}
    code, output = run("tenant", "list", **env)
    assert code == 1 and output.startswith("UNAVAILABLE: "), output
    assert "kvstrata --tls-ca CA.pem" in output  # fresh-user trial 24: it said only "Socket closed"
    code, output = run("--tls-ca", str(certs.ca), "tenant", "list", **env)
    assert code == 0, output
    code, output = run("tenant", "list", **env, KVSTRATA_TLS_CA=str(certs.ca))
    assert code == 0, output
    code, output = run("--tls-ca", str(certs.server.key), "tenant", "list", **env)  # a key is no CA
    assert code == 1 and output.startswith("UNAVAILABLE: "), output
    code, output = run("--tls-ca", "/nonexistent/ca.pem", "tenant", "list", **env)
    assert code == 1 and output.strip() == "CA file /nonexistent/ca.pem: cannot read it: No such file or directory", \
        output


def test_the_saved_admin_key_still_goes_only_to_its_own_gateway(gateway: Gateway, certs: TlsMaterial,
                                                                tmp_path: Path) -> None:
    """Regression guard (review 23d, B) with TLS: --tls-ca does not make another gateway the
    saved deployment's; the saved key is not sent there."""
    save_up_state(tmp_path, gateway, tls=True, tls_ca_file=str(certs.ca))
    code, output = run("--tls-ca", str(certs.ca), "tenant", "list", "--gateway", "localhost:1")
    assert code == 1 and output.startswith("no admin key for localhost:1"), output


def test_mutual_tls_needs_the_client_certificate(mutual_gateway: Gateway, certs: TlsMaterial,
                                                 tmp_path: Path) -> None:
    """A gateway requiring client certificates: refused without one (UNAVAILABLE), served with
    --tls-cert/--tls-key (or KVSTRATA_TLS_CERT/KEY); one of the two alone is a usage error."""
    save_up_state(tmp_path, mutual_gateway, tls=True, tls_ca_file=str(certs.ca))
    code, output = run("tenant", "list")
    assert code == 1 and output.startswith("UNAVAILABLE: "), output
    assert "--tls-cert and --tls-key" in output, output  # fresh-user trial 24: "Socket closed" alone
    code, output = run("--tls-cert", str(certs.client.cert), "--tls-key", str(certs.client.key), "tenant", "list")
    assert code == 0, output
    code, output = run("tenant", "list", KVSTRATA_TLS_CERT=str(certs.client.cert),
                       KVSTRATA_TLS_KEY=str(certs.client.key))
    assert code == 0, output
    code, output = run("--tls-cert", str(certs.client.cert), "tenant", "list")
    assert code == 2 and "--tls-cert / --tls-key: a client certificate needs its key" in output, output


def test_generate_reaches_a_tls_gateway(gateway: Gateway, certs: TlsMaterial, tmp_path: Path) -> None:
    """`kvstrata generate` (a streamed call) goes over the secure channel too: the gateway
    answers it (here: its key check refuses an unknown key) rather than the channel failing."""
    save_up_state(tmp_path, gateway, tls=True, tls_ca_file=str(certs.ca))
    code, output = run("generate", "hello", KVSTRATA_API_KEY="sk-not-a-tenant")
    assert code == 1 and output.startswith("UNAUTHENTICATED: "), output


def test_a_plaintext_channel_is_what_a_tls_gateway_refuses(gateway: Gateway) -> None:
    """The fixture's gateway speaks TLS only (what the tests above rely on)."""
    with grpc.insecure_channel(gateway.address) as channel, pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=1)


def test_up_says_tls_is_on_or_warns_of_cleartext(certs: TlsMaterial, tmp_path: Path) -> None:
    """`up`'s summary: with TLS the gateway line says so (and whether client certificates are
    required) and the OpenAI API's URL is https; a plaintext gateway beyond loopback gets a
    warning line, one on loopback none."""
    def summary(**settings: object) -> list[str]:
        cfg = ServiceConfig(state_dir=str(tmp_path), **settings)
        return [ANSI_MARKUP.sub("", line) for line in up_summary(cfg, "h:1", "h:2", {}, None)]

    files = {"tls_cert_file": str(certs.server.cert), "tls_key_file": str(certs.server.key)}
    assert summary(**files)[:2] == ["gateway: h:1 (TLS)", "OpenAI-compatible API: https://h:2/v1"]
    assert summary(**files, tls_client_ca_file=str(certs.ca))[0] == "gateway: h:1 (TLS, client certificates required)"
    assert summary(gateway_host="0.0.0.0")[:3] == [
        "gateway: h:1",
        "warning: no TLS on 0.0.0.0: API keys cross the network in cleartext (set tls_cert_file and tls_key_file)",
        "OpenAI-compatible API: http://h:2/v1"]
    assert summary()[:2] == ["gateway: h:1", "OpenAI-compatible API: http://h:2/v1"]


def test_any_tls_option_means_tls_never_plaintext(tmp_path: Path, certs: TlsMaterial) -> None:
    """Review 24r F7: ``--tls-server-name`` (or KVSTRATA_TLS_SERVER_NAME) alone gave a plaintext
    channel, and a plaintext server at the address received the admin key (the tenant list
    came back, exit 0). Now it, and ``--tls`` (the system's roots), mean TLS: a plaintext
    gateway's answer is never read (UNAVAILABLE), the key never sent in clear."""
    with serve(tmp_path / "plain") as plain:
        env = {"KVSTRATA_GATEWAY": plain.address, "KVSTRATA_ADMIN_KEY": plain.admin_key}
        assert run("tenant", "list", **env)[0] == 0  # plaintext asked for: plaintext
        for args, extra in ((["--tls-server-name", "localhost"], {}), ([], {"KVSTRATA_TLS_SERVER_NAME": "localhost"}),
                            (["--tls"], {}), ([], {"KVSTRATA_TLS": "1"})):
            code, output = run(*args, "tenant", "list", **env, **extra)
            assert code == 1 and output.startswith("UNAVAILABLE: "), (args, extra, output)


def test_the_https_client_trusts_only_the_given_ca(certs: TlsMaterial) -> None:
    """Review 24r F8: with ``tls_ca_file`` the HTTPS clients (workload, demo, benches) trusted
    every system root besides (145 CAs); gRPC's credentials trust only the file. Now the same."""
    from services.tls import ClientTls

    assert len(ClientTls(ca_file=str(certs.ca)).ssl_context().get_ca_certs()) == 1
    assert ClientTls().ssl_context().verify_mode.name == "CERT_REQUIRED"


def test_the_saved_tls_gateway_spelled_otherwise_is_still_tls(gateway: Gateway, certs: TlsMaterial,
                                                              tmp_path: Path) -> None:
    """Review 24s: ``localhost:<port>`` for the saved TLS gateway ``127.0.0.1:<port>`` got a
    plaintext channel (a tenant's key, from KVSTRATA_API_KEY, went to whoever answered there in
    clear). An address resolving to the saved one's is the saved gateway: TLS with its CA,
    verified for the saved host (the certificate names it)."""
    save_up_state(tmp_path, gateway, tls=True, tls_ca_file=str(certs.ca))
    port = gateway.address.rpartition(":")[2]
    assert cli_state.same_endpoint(f"localhost:{port}", gateway.address)
    assert not cli_state.same_endpoint(f"localhost:{int(port) + 1}", gateway.address)
    tls = cli_state.client_tls(f"localhost:{port}")
    assert tls is not None and tls.ca_file == str(certs.ca) and tls.server_name == "127.0.0.1"
    _, key = gateway.scheduler.store.register(TenantSpec("ann"))
    code, output = run("tenant", "show", "ann", "--gateway", f"localhost:{port}", KVSTRATA_API_KEY=key)
    assert code == 0 and "ann" in output, output
