"""The gateway's TLS settings (``ServiceConfig.tls_*``, ``services.tls``) are checked where the
config is loaded: a half-set pair, an unreadable file, a file that is not PEM or a key that is not
the certificate's fails ``kvstrata up`` at once (a usage error naming the file), never as a gateway
that hangs or an actor Ray restarts in a loop; relative paths are made absolute there."""

from __future__ import annotations

import os
from pathlib import Path

import pydantic
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from typer.testing import CliRunner

from cli import lifecycle
from cli import main as cli
from services.config import ServiceConfig, load_config
from services.tls import ClientTls, ServerTls
from tests.tls_certs import TlsMaterial, make_tls_material


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return make_tls_material(tmp_path_factory.mktemp("tls"))


def refusal(**settings: str) -> str:
    """The message ``ServiceConfig(**settings)`` is refused with."""
    with pytest.raises(pydantic.ValidationError) as err:
        ServiceConfig(**settings)
    errors = err.value.errors()
    assert len(errors) == 1, errors
    return str(errors[0]["ctx"]["error"])


def test_a_certificate_and_key_go_together_and_mutual_tls_needs_them(certs: TlsMaterial) -> None:
    pair = "tls_cert_file and tls_key_file go together: set both (TLS on the gateway) or neither"
    assert refusal(tls_cert_file=str(certs.server.cert)) == pair
    assert refusal(tls_key_file=str(certs.server.key)) == pair
    assert refusal(tls_client_ca_file=str(certs.ca)) == \
        "tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file too"


def test_unreadable_files_are_named(certs: TlsMaterial, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    assert refusal(tls_cert_file=str(missing), tls_key_file=str(certs.server.key)) == \
        f"tls_cert_file {missing}: cannot read it: No such file or directory"
    assert refusal(tls_cert_file=str(certs.server.cert), tls_key_file=str(tmp_path)) == \
        f"tls_key_file {tmp_path}: cannot read it: Is a directory"
    assert refusal(tls_cert_file=str(certs.server.cert), tls_key_file=str(certs.server.key),
                   tls_client_ca_file=str(missing)) == \
        f"tls_client_ca_file {missing}: cannot read it: No such file or directory"
    assert refusal(tls_ca_file=str(missing)) == f"tls_ca_file {missing}: cannot read it: No such file or directory"


def test_a_bad_pem_is_named(certs: TlsMaterial, tmp_path: Path) -> None:
    """Not PEM, a key where the certificate goes, a truncated certificate, the key of another
    certificate, an encrypted key (refused, never a password prompt on the terminal)."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(os.urandom(64))
    truncated = tmp_path / "truncated.pem"
    truncated.write_text(certs.server.cert.read_text()[:200] + "\n-----END CERTIFICATE-----\n")
    key = str(certs.server.key)
    for bad in (garbage, certs.server.key, truncated):
        message = refusal(tls_cert_file=str(bad), tls_key_file=key)
        assert message.startswith(f"tls_cert_file {bad}: not PEM certificates ("), message
    assert refusal(tls_cert_file=str(certs.server.cert), tls_key_file=str(certs.client.key)).startswith(
        f"tls_key_file {certs.client.key}: not the unencrypted PEM private key of tls_cert_file {certs.server.cert} "
        "([X509: KEY_VALUES_MISMATCH]")
    encrypted = tmp_path / "encrypted.key"
    loaded = serialization.load_pem_private_key(certs.server.key.read_bytes(), None)
    encrypted.write_bytes(loaded.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.BestAvailableEncryption(b"secret")))
    assert refusal(tls_cert_file=str(certs.server.cert), tls_key_file=str(encrypted)) == (
        f"tls_key_file {encrypted}: not the unencrypted PEM private key of tls_cert_file {certs.server.cert} "
        "(the key is encrypted)")
    assert refusal(tls_cert_file=str(certs.server.cert), tls_key_file=key, tls_client_ca_file=str(garbage)) \
        .startswith(f"tls_client_ca_file {garbage}: not PEM certificates (")


def test_relative_tls_paths_are_made_absolute_where_the_config_is_loaded(
        certs: TlsMaterial, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As state_dir (review 23d, C): the gateway actor and later commands run elsewhere."""
    monkeypatch.chdir(certs.ca.parent)
    named = tmp_path / "tls.yaml"
    named.write_text(yaml.safe_dump({"tls_cert_file": "server.pem", "tls_key_file": "server.key",
                                     "tls_client_ca_file": "ca.pem", "tls_ca_file": "./ca.pem"}))
    cfg = load_config(named)
    assert (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file, cfg.tls_ca_file) == \
        (str(certs.server.cert), str(certs.server.key), str(certs.ca), str(certs.ca))
    assert ServerTls.of(cfg) == ServerTls(str(certs.server.cert), str(certs.server.key), str(certs.ca))
    assert ServerTls.of(cfg).mutual
    assert ClientTls.of_config(cfg) == ClientTls(str(certs.ca))
    assert ServerTls.of(ServiceConfig()) is None and ClientTls.of_config(ServiceConfig()) is None


def test_up_with_a_bad_tls_file_is_a_usage_error_naming_it(certs: TlsMaterial, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvstrata up` refuses the config before it starts anything (no Ray, no state)."""
    def must_not_start(*args: object) -> None:
        raise AssertionError("up started Ray with a bad TLS file")

    monkeypatch.setattr(lifecycle, "_start_local_ray", must_not_start)
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"tls_cert_file": str(certs.server.cert), "tls_key_file": str(certs.ca),
                                      "state_dir": str(tmp_path / "state")}))
    result = CliRunner().invoke(cli.app, ["up", "--config", str(config)],
                                env={"KVSTRATA_STATE_DIR": str(tmp_path / "cli"), "COLUMNS": "1000",
                                     "TERMINAL_WIDTH": "1000"})
    assert result.exit_code == 2, result.output
    words = " ".join(result.output.replace("│", " ").split())
    assert f"Invalid value for '--config': {config}: tls_key_file {certs.ca}: not the unencrypted PEM" in words, words
    assert not (tmp_path / "cli" / "gateway.json").exists()
