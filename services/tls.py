"""TLS on the gateway's client-facing endpoints (its gRPC port and the OpenAI-compatible HTTP
API), and on kvstrata's own clients of them (the CLI, the workloads, the benchmarks).

Server side, ``ServerTls``: the PEM files of ``ServiceConfig``'s ``tls_cert_file``,
``tls_key_file`` and (mutual TLS) ``tls_client_ca_file``. They are checked where the config is
loaded (``check``: a missing or unreadable file, a bad PEM or a key that is not the
certificate's fails ``kvstrata up`` with an error naming the file) and read again at each
gateway start, so a restarted gateway serves the files as they are then.

Client side, ``ClientTls``: the CA bundle that verifies the gateway's certificate (none: the
system's trust roots), the name that certificate must carry (``server_name``: ``ServiceConfig``'s
``tls_server_name``; none: the host dialed) and, for mutual TLS, a client certificate and key;
``open_channel`` and ``open_aio_channel`` give a secure gRPC channel with it, or a plaintext one
without, and ``http_client_options`` an httpx client's. ``dial_address``: where a client on the
gateway's machine dials a server bound on a wildcard address (loopback, which a certificate can
name, rather than ``0.0.0.0``, which none does).

A gateway bound on a non-loopback address without TLS serves, but says once per process that
API keys cross the network in cleartext (``warn_cleartext``). docs/architecture.md, 'Tenancy
and security'.

Regression (security review: no TLS anywhere): the gateway listened with
``add_insecure_port`` and plain HTTP, and every client opened an insecure channel, so the
admin and tenant API keys crossed the network in cleartext.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger(__name__)

_warned: set[str] = set()  # the hosts ``warn_cleartext`` warned of in this process


def read_pem(field: str, path: str) -> bytes:
    """The bytes of the file ``path`` that the setting ``field`` names.

    Raises:
        ValueError: it cannot be read (naming ``field``, the file and why)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{field} {path}: cannot read it: {exc.strerror or exc}") from None


def check_certificates(field: str, path: str) -> bytes:
    """The PEM certificates in ``path`` (a certificate, a chain or a CA bundle); returns its bytes.

    Raises:
        ValueError: unreadable, or no PEM certificate in it, or a malformed one."""
    pem = read_pem(field, path)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{field} {path}: not PEM certificates ({_reason(exc)})") from None
    return pem


def _encrypted_key() -> bytes:
    """``load_cert_chain``'s password callback: refuse, rather than let OpenSSL ask on a terminal."""
    raise ValueError("the key is encrypted")


def _reason(exc: Exception) -> str:
    """An ``ssl`` error's message without its source location (``(_ssl.c:3926)``)."""
    return re.sub(r"\s*\(_ssl\.c:\d+\)$", "", str(exc)) or type(exc).__name__


@dataclass(frozen=True)
class ServerTls:
    """The gateway's certificate (chain) and key, PEM files, and with ``client_ca_file`` mutual
    TLS: only clients presenting a certificate signed by a CA in it are served."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    @classmethod
    def of(cls, config: Any) -> ServerTls | None:
        """``config``'s (a ``ServiceConfig``) TLS settings; None when TLS is off."""
        if not config.tls_cert_file:
            return None
        return cls(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)

    def check(self) -> None:
        """Every file readable and what it should be: the certificate PEM certificates, the key
        the unencrypted PEM private key of its first one, the client CA PEM certificates.

        Raises:
            ValueError: naming the setting, the file and what is wrong with it."""
        check_certificates("tls_cert_file", self.cert_file)
        read_pem("tls_key_file", self.key_file)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert_file, self.key_file,
                                                                   password=_encrypted_key)
        except (ssl.SSLError, ValueError, OSError) as exc:
            raise ValueError(f"tls_key_file {self.key_file}: not the unencrypted PEM private key of tls_cert_file "
                             f"{self.cert_file} ({_reason(exc)})") from None
        if self.client_ca_file:
            check_certificates("tls_client_ca_file", self.client_ca_file)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The gRPC server's credentials from the files as they are now (checked first).

        Raises:
            ValueError: as ``check``."""
        self.check()
        key, chain = read_pem("tls_key_file", self.key_file), read_pem("tls_cert_file", self.cert_file)
        roots = read_pem("tls_client_ca_file", self.client_ca_file) if self.mutual else None
        return grpc.ssl_server_credentials([(key, chain)], root_certificates=roots, require_client_auth=self.mutual)

    def ssl_context(self) -> ssl.SSLContext:
        """The HTTPS server's context from the files as they are now (checked first); it verifies
        client certificates (required) with ``client_ca_file``.

        Raises:
            ValueError: as ``check``."""
        self.check()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file, password=_encrypted_key)
        if self.mutual:
            context.load_verify_locations(cafile=self.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


def check_server_settings(cert_file: str, key_file: str, client_ca_file: str) -> None:
    """``ServiceConfig``'s TLS settings as a whole: certificate and key both or neither, a client
    CA only with them, and (when set) the files as ``ServerTls.check`` wants them.

    Raises:
        ValueError: what is wrong, naming the setting and the file."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("tls_cert_file and tls_key_file go together: set both (TLS on the gateway) or neither")
    if client_ca_file and not cert_file:
        raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file too")
    if cert_file:
        ServerTls(cert_file, key_file, client_ca_file).check()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def dial_address(address: str, server_ip: str = "") -> str:
    """The ``host:port`` a client on this machine dials for a server bound on ``address``
    (``host:port``): a wildcard host (``0.0.0.0``, ``::``) becomes ``server_ip`` when the
    server runs on another machine (its node's address), else loopback (``127.0.0.1``,
    ``[::1]``), which that bind serves too and a certificate can name; an IPv6 address is
    bracketed; anything else ("", a name) is unchanged.

    Regression: on a joined cluster whose gateway actor Ray placed on another machine, a
    wildcard bind was saved as loopback (before that, as ``0.0.0.0``), which reaches this
    machine, where no gateway listens.

    Regression (a wildcard gateway_host with TLS): ``kvstrata up`` saved ``0.0.0.0:port`` and
    the CLI verified the gateway's certificate against ``0.0.0.0``, which no certificate names."""
    host, sep, port = address.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]")) if sep else None
    except ValueError:
        ip = None
    if ip is None:
        return address
    if ip.is_unspecified:
        ip = ipaddress.ip_address(server_ip or ("127.0.0.1" if ip.version == 4 else "::1"))
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def check_server_name(name: str) -> str:
    """``name`` (``tls_server_name``) when it is a host name or IP address (no port, scheme or path).

    Raises:
        ValueError: it is not."""
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if name and not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?", name):
        raise ValueError(f"tls_server_name {name!r}: not a host name or IP address (no port, scheme or path)")
    return name


def warn_cleartext(host: str, apis: str) -> bool:
    """Log a WARNING, once per process and host, that ``apis`` bound on the non-loopback ``host``
    without TLS carry API keys in cleartext; returns whether it logged now."""
    if is_loopback(host) or host in _warned:
        return False
    _warned.add(host)
    log.warning("%s listen on %s without TLS: admin and tenant API keys cross the network in cleartext; "
                "set tls_cert_file and tls_key_file (services.tls)", apis, host)
    return True


@dataclass(frozen=True)
class ClientTls:
    """How a client verifies the gateway and, for mutual TLS, proves itself.

    Attributes:
        ca_file: PEM CA bundle the gateway's certificate must chain to ("": the system's roots).
        cert_file / key_file: the client's certificate (chain) and key, PEM ("": none).
        server_name: the name the gateway's certificate must carry, also sent as SNI ("": the
            host dialed). gRPC: ``grpc.ssl_target_name_override`` and ``grpc.default_authority``;
            httpx: the ``sni_hostname`` request extension (``http_client_options``).

    Raises:
        ValueError: only one of ``cert_file`` and ``key_file``."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs its key, and a key its certificate: give both or neither")

    @classmethod
    def of_config(cls, config: Any) -> ClientTls | None:
        """What kvstrata's in-process clients of a gateway started with ``config`` (a
        ``ServiceConfig``) use: its ``tls_ca_file`` and ``tls_server_name``; None when its TLS is off."""
        return cls(ca_file=config.tls_ca_file, server_name=config.tls_server_name) if config.tls_cert_file else None

    def channel_options(self) -> list[tuple[str, str]]:
        """gRPC channel options verifying (and asking for) ``server_name``, when set."""
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name), ("grpc.default_authority", self.server_name)]

    def http_client_options(self) -> dict[str, Any]:
        """Arguments of an ``httpx.AsyncClient`` (``openai.DefaultAsyncHttpxClient``) verifying
        with this: ``verify``, and with ``server_name`` a request hook setting each request's
        ``sni_hostname`` extension (the name httpcore sends as SNI and checks the certificate for).

        Raises:
            ValueError: as ``ssl_context``."""
        options: dict[str, Any] = {"verify": self.ssl_context()}
        if self.server_name:
            name = self.server_name

            async def verify_as(request: Any) -> None:
                request.extensions["sni_hostname"] = name
            options["event_hooks"] = {"request": [verify_as]}
        return options

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        """Raises ValueError: a file cannot be read (naming it)."""
        roots = read_pem("CA file", self.ca_file) if self.ca_file else None
        if not self.cert_file:
            return grpc.ssl_channel_credentials(root_certificates=roots)
        return grpc.ssl_channel_credentials(root_certificates=roots,
                                            private_key=read_pem("client key", self.key_file),
                                            certificate_chain=read_pem("client certificate", self.cert_file))

    def ssl_context(self) -> ssl.SSLContext:
        """For an HTTP client (``httpx``' ``verify=``): verifies the server's certificate and host name.

        Raises:
            ValueError: a file cannot be read or is not PEM (naming it)."""
        # only ``ca_file``'s CAs when given, as gRPC's credentials (review 24r F8: the system's
        # roots were trusted besides, so any public CA's certificate for the name passed)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and host name
        if self.ca_file:
            context.load_verify_locations(cadata=check_certificates("CA file", self.ca_file).decode("ascii"))
        else:
            context.load_default_certs()
        if self.cert_file:
            try:
                context.load_cert_chain(self.cert_file, self.key_file, password=_encrypted_key)
            except (ssl.SSLError, ValueError, OSError) as exc:
                raise ValueError(f"client certificate {self.cert_file} / key {self.key_file}: {_reason(exc)}") from None
        return context


def open_channel(target: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to ``target``: secure with ``tls`` (verifying its ``server_name``), plaintext without."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.grpc_credentials(), options=[*options, *tls.channel_options()])


def open_aio_channel(target: str, tls: ClientTls | None,
                     options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """``open_channel`` for ``grpc.aio``."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.grpc_credentials(), options=[*options, *tls.channel_options()])


def http_scheme(tls: ClientTls | ServerTls | None) -> str:
    """``https`` with TLS, else ``http``."""
    return "https" if tls is not None else "http"
