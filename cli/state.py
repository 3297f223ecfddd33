"""Where the commands find the gateway, how they reach it (plaintext or TLS) and the admin
key: flags, the environment (KVSTRATA_GATEWAY, KVSTRATA_ADMIN_KEY, KVSTRATA_TLS_CA,
KVSTRATA_TLS_CERT, KVSTRATA_TLS_KEY, KVSTRATA_TLS_SERVER_NAME) or the state ``kvstrata up``
wrote to ``state_dir()``."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
from rich.markup import escape

from cli.output import EXIT_USAGE, console, die
from services.actor_calls import SCHEDULER_CALL_TIMEOUT_S
from services.grpc_messages import DEFAULT_MAX_MESSAGE_BYTES, client_channel_options
from services.private_dir import UnsafeDirectoryError, check_private_dir
from services.tls import ClientTls, open_aio_channel, open_channel
from tenants.keys import read_key_file, write_private_file

RPC_TIMEOUT_S = SCHEDULER_CALL_TIMEOUT_S + 15.0
"""Deadline of the CLI's unary calls to the gateway (a gateway that never answers ends them):
past the gateway's own deadline on a call to the global scheduler (``SCHEDULER_CALL_TIMEOUT_S``),
so a stalled scheduler is reported with the gateway's UNAVAILABLE and its message, not a bare
DEADLINE_EXCEEDED. Regression (trial 29k P6): both were 30 s, and the client's fired first."""

STATE_DIR: Path | None = None  # pinned by tests; else ``state_dir()`` reads the environment


@dataclass(frozen=True)
class TlsOptions:
    """The ``kvstrata --tls-ca/--tls-cert/--tls-key`` options (or KVSTRATA_TLS_*); "": not given."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    tls: bool = False  # ``--tls``: TLS for any gateway, verified with the system's roots

    def any(self) -> bool:
        """Whether anything of TLS was asked for (then never plaintext)."""
        return bool(self.tls or self.ca_file or self.cert_file or self.key_file or self.server_name)


TLS_OPTIONS = TlsOptions()
"""Set by the app's callback (``cli.main``) on each invocation."""


def state_dir() -> Path:
    """``STATE_DIR`` when pinned, else KVSTRATA_STATE_DIR, else ~/.kvstrata: read at each call,
    so a command run in-process (typer's CliRunner) with another environment sees its own."""
    return STATE_DIR or Path(os.environ.get("KVSTRATA_STATE_DIR") or "~/.kvstrata").expanduser()


STATE_FILE = "gateway.json"
_MAX_STATE_BYTES = 1 << 20  # a few hundred bytes are written; more is no state of ours


def read_state() -> dict:
    """What ``kvstrata up`` saved (``STATE_DIR/gateway.json``); {} when nothing is up. Exits 1
    when another user could have written it (``services.private_dir``): it names the gateway
    the admin key is sent to. A file that is no saved state (cut short, not a JSON object, past
    ``_MAX_STATE_BYTES``) is {} too, with a warning naming it: ``up`` writes it again.

    Regression (s38 durability audit): ``up`` wrote it in place, unsynced, and this parsed it
    unchecked, so a file cut short by a crash made ``down``, ``up`` and every client command
    end in a JSONDecodeError traceback until someone deleted it."""
    path = state_dir() / STATE_FILE
    if not path.exists():
        return {}
    try:
        check_private_dir(path.parent)
    except UnsafeDirectoryError as exc:
        die(str(exc))
    with open(path, "rb") as f:
        text = f.read(_MAX_STATE_BYTES + 1)
    try:
        saved = json.loads(text) if len(text) <= _MAX_STATE_BYTES else None
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        saved = None
    if not isinstance(saved, dict):
        console.print(f"[yellow]{escape(str(path))} is no state kvstrata saved (cut short by a crash?): "
                      "ignored; `kvstrata up` writes it again[/yellow]", soft_wrap=True)
        return {}
    return saved


def write_state(saved: dict) -> None:
    """Save ``saved`` (JSON) as what ``read_state`` reads: atomic and durable (a crash leaves
    the old file or the new one, whole), readable by the owner only (``write_private_file``).

    Raises:
        OSError: the state directory cannot be written."""
    write_private_file(state_dir() / STATE_FILE, json.dumps(saved))


def gateway_address(address: str | None) -> str:
    """``address``, else KVSTRATA_GATEWAY, else the saved one; exits 1 when there is none
    (nothing is up to talk to)."""
    addr = address or os.environ.get("KVSTRATA_GATEWAY") or read_state().get("address")
    if not addr:
        die("no gateway address: run `kvstrata up` or pass --gateway")
    return addr


def client_tls(address: str) -> ClientTls | None:
    """How to reach the gateway at ``address`` (None: plaintext). TLS when ``kvstrata up`` saved
    this address with TLS on (verified with the CA bundle its config named, ``tls_ca_file``,
    unless ``--tls-ca`` names another, and for the name its ``tls_server_name`` gave, unless
    ``--tls-server-name`` gives another; none: the host dialed), or when any TLS option is given
    (``--tls``, ``--tls-ca``, ``--tls-cert``/``--tls-key``, ``--tls-server-name``: for any
    gateway; without a CA, the system's roots verify it); the client certificate (mutual TLS)
    is ``--tls-cert``/``--tls-key``'s. Exits 2 when only one of those two is given.

    Regression (security review: no TLS anywhere): every command opened a plaintext channel,
    so the admin and tenant keys crossed the network in cleartext. Regression (review 24r F7):
    ``--tls-server-name`` alone, or a gateway not spelled as the saved address, still got a
    plaintext channel, and whoever answered plaintext there received the key. Regression
    (review 24s): the saved TLS gateway spelled otherwise (``localhost:p`` for the saved
    ``127.0.0.1:p``) got a plaintext channel; an address that resolves to the saved one's is
    the saved gateway (verified for the name the saved address was, when none was given)."""
    options, saved = TLS_OPTIONS, read_state()
    saved_address = saved.get("address", "")
    ours = bool(saved.get("tls")) and same_endpoint(address, saved_address)
    if not (ours or options.any()):
        return None
    ca_file = options.ca_file or (saved.get("tls_ca_file", "") if ours else "")
    server_name = options.server_name or (saved.get("tls_server_name", "") if ours else "")
    if ours and not server_name and address != saved_address:
        server_name = saved_address.rpartition(":")[0].strip("[]")
    try:
        return ClientTls(ca_file, options.cert_file, options.key_file, server_name)
    except ValueError as exc:
        die(f"--tls-cert / --tls-key: {exc}", EXIT_USAGE)


def same_endpoint(a: str, b: str) -> bool:
    """Whether ``host:port`` addresses ``a`` and ``b`` reach the same place: spelled alike, or
    the same port on hosts that resolve to a shared address (``localhost`` and ``127.0.0.1``).
    An address that does not resolve is the same only as itself."""
    if a == b:
        return True
    (host_a, _, port_a), (host_b, _, port_b) = a.rpartition(":"), b.rpartition(":")
    if not (port_a and port_a == port_b and host_a and host_b):
        return False
    try:
        ips = [{info[4][0] for info in socket.getaddrinfo(h.strip("[]"), int(port_a), type=socket.SOCK_STREAM)}
               for h in (host_a, host_b)]
    except (OSError, ValueError):
        return False
    return bool(ips[0] & ips[1])


def _message_cap() -> int:
    """The gateway's ``grpc_max_message_bytes`` (saved by ``kvstrata up``) or the default,
    whichever is larger: either takes the largest valid request (``services.grpc_messages``)."""
    saved = read_state().get("grpc_max_message_bytes")
    return max(saved if isinstance(saved, int) else 0, DEFAULT_MAX_MESSAGE_BYTES)


def gateway_channel(address: str | None) -> grpc.Channel:
    """A channel to ``gateway_address(address)``, secure as ``client_tls`` says, whose messages
    may be as large as ``_message_cap()``. Exits 1 when a TLS file cannot be read."""
    target = gateway_address(address)
    try:
        return open_channel(target, client_tls(target), client_channel_options(_message_cap()))
    except ValueError as exc:
        die(str(exc))


def gateway_aio_channel(address: str | None) -> grpc.aio.Channel:
    """``gateway_channel`` for ``grpc.aio`` (run on a running event loop)."""
    target = gateway_address(address)
    try:
        return open_aio_channel(target, client_tls(target), client_channel_options(_message_cap()))
    except ValueError as exc:
        die(str(exc))


def openai_api_url(url: str) -> str:
    """``url``, else KVSTRATA_OPENAI_URL, else the saved HTTP address's ``/v1`` (``https://``
    when ``kvstrata up`` saved TLS on, else ``http://``); exits 1 when there is none."""
    state = read_state()
    saved, scheme = state.get("http_address"), "https" if state.get("tls") else "http"
    url = url or os.environ.get("KVSTRATA_OPENAI_URL") or (f"{scheme}://{saved}/v1" if saved else "")
    if not url:
        die("no OpenAI-compatible API address: pass --openai-url (http://host:port/v1) or `kvstrata up` "
            "with http_port set")
    return url


def admin_key_file() -> Path:
    return Path(read_state().get("state_dir", state_dir())) / "admin_key"


def admin_key(gateway: str | None) -> tuple[str, Path | None]:
    """The admin key for the gateway ``gateway_address(gateway)``, and the file it came from
    (None: KVSTRATA_ADMIN_KEY). The saved deployment's key file serves only that deployment's
    gateway (the address ``kvstrata up`` saved): a key goes only where it belongs. Exits 1
    when there is none.

    Regression (review 23d, B): the saved key went, in the clear, to whatever --gateway or
    KVSTRATA_GATEWAY named, and ``admin rotate-key`` against another gateway wrote that
    gateway's new key over the saved deployment's only key file."""
    key = os.environ.get("KVSTRATA_ADMIN_KEY")
    if key:
        return key, None
    address, saved = gateway_address(gateway), read_state().get("address", "")
    if address != saved:
        whose = f"the saved admin key is for {saved} only" if saved else "no deployment was started here (`kvstrata up`)"
        die(f"no admin key for {address}: {whose}; set KVSTRATA_ADMIN_KEY")
    path = admin_key_file()
    key = read_key_file(path)
    if not key:
        die("no admin key: set KVSTRATA_ADMIN_KEY (lost? `kvstrata admin rotate-key --local`)")
    return key, path


def admin_metadata(gateway: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``admin_key(gateway)``; exits 1 when there is none."""
    return (("authorization", f"Bearer {admin_key(gateway)[0]}"),)


def reachable(address: str, timeout_s: float = 2.0) -> bool:
    """True when a TCP connection to ``host:port`` opens within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
