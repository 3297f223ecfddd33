"""Throwaway TLS material for tests: a CA, a server certificate for 127.0.0.1 / localhost and
a client certificate, made with ``cryptography`` in a test's temporary directory (no key
material is ever committed)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class TlsMaterial:
    """``ca``: the CA's certificate (PEM); ``server`` / ``client``: pairs signed by it."""

    ca: Path
    server: Pair
    client: Pair


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _builder(subject: str, issuer: str, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
            .public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def make_ca(directory: Path, name: str = "ca") -> tuple[Path, ec.EllipticCurvePrivateKey]:
    """A self-signed CA certificate at ``directory/<name>.pem``; returns (its path, its key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(f"kvstrata test {name}", f"kvstrata test {name}", key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key


SERVER_NAMES = ("localhost", "127.0.0.1", "::1")
"""The names a server certificate carries by default: DNS names and IP addresses."""


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def issue(directory: Path, name: str, ca_key: ec.EllipticCurvePrivateKey, ca_name: str, server: bool,
          names: tuple[str, ...] = SERVER_NAMES) -> Pair:
    """A certificate signed by the CA ``ca_name`` (``make_ca``) at ``directory/<name>.pem`` and its
    key at ``<name>.key``: a server's names ``names`` (default 127.0.0.1, ::1 and localhost); a
    client's is for client authentication."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(name, f"kvstrata test {ca_name}", key.public_key()).add_extension(
        x509.BasicConstraints(ca=False, path_length=None), critical=True)
    if server:
        builder = builder.add_extension(_san(names), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    pair = Pair(directory / f"{name}.pem", directory / f"{name}.key")
    pair.cert.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    _write_key(key, pair.key)
    return pair


def make_tls_material(directory: Path) -> TlsMaterial:
    """A CA with a server and a client certificate under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = make_ca(directory)
    return TlsMaterial(ca, issue(directory, "server", ca_key, "ca", server=True),
                       issue(directory, "client", ca_key, "ca", server=False))
