"""Who may talk on the data plane (``services.data_plane``): ZeroMQ CURVE keys and bind hosts.

Every data-plane socket of a deployment is CURVE-authenticated and encrypted, on loopback too
(one rule everywhere; a CURVE handshake is once per connection, and encryption costs
microseconds per message). The launcher makes one key pair per role at start
(``DataPlaneKeys.generate``) and hands each actor its ``Security`` as a constructor argument, so
a restarted actor (Ray re-runs its constructor with the same arguments) keeps its keys. A
socket that serves accepts only the roles that send to it, checked by a ZAP authenticator
against their public keys:

============  ==========================  ==============================
role          serves (binds)              accepts messages from
============  ==========================  ==============================
scheduler     admissions (``ROUTER``)     gateway
node          command inbox (``PULL``)    gateway (aborts), scheduler
gateway       event inbox (``PULL``)      node
============  ==========================  ==============================

Each cache node also has its own client key pair (``DataPlaneKeys.node_clients``, ``Security
.client``), with which it sends its events: a gateway's event inbox admits those keys, not the
shared node key, and drops an event from any node but the one serving its request
(``NodeStreams._read_events``). The node's inbox also checks each message's sender (its ZAP
User-Id, the sender's public key; ``Security.key_names``) against the ops that role sends
(``cache_node_commands.OPS_BY_ROLE``): the gateway's key sends aborts only. A peer without the
keys gets no connection: ZeroMQ drops the handshake, the serving process
never sees a byte of what it sent. The fields a message carries (tenant, namespace, SLO,
quota) are trusted only because of this: only the gateway, which authenticated the tenant,
and the scheduler can send them.

Sockets bind on ``Security.host``: loopback for a cluster on one machine, else the Ray node's
IP (``ServiceConfig.data_plane_bind``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth.asyncio

ROLES = ("gateway", "scheduler", "node")

SENDERS = {"scheduler": ("gateway",), "node": ("gateway", "scheduler"), "gateway": ("node",)}
"""role -> the roles whose messages its serving socket accepts."""

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, Z85-encoded (40 bytes each). Its ``repr`` (and so that of a
    ``Security`` or ``DataPlaneKeys`` holding it: a log line, a traceback with locals) leaves
    the secret key out."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


@dataclass(frozen=True)
class Security:
    """One process's data-plane identity.

    Attributes:
        role: "gateway", "scheduler" or "node".
        keys: this role's key pair.
        publics: role -> that role's public key (every role).
        host: the address to bind on; "" = this Ray node's IP (``data_plane.host_ip``).
        client: a cache node's own key pair for the sockets it connects (its events to the
            gateways), so a gateway knows which node sent an event; None: ``keys``.
        node_clients: on a gateway, node id -> that node's ``client`` public key: its event
            inbox admits those (not the shared node key) and tells the sender of each event.
    """

    role: str
    keys: KeyPair
    publics: dict[str, bytes]
    host: str = LOOPBACK
    client: KeyPair | None = None
    node_clients: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown data-plane role {self.role!r}; known roles: {list(ROLES)}")
        missing = set(ROLES) - set(self.publics)
        if missing:
            raise ValueError(f"public keys missing for roles {sorted(missing)}")

    def allowed(self) -> set[bytes]:
        """Public keys (Z85) of the roles this role's serving socket accepts (each node's own
        client key in place of the shared node key, when ``node_clients`` names them)."""
        roles = [r for r in SENDERS[self.role] if not (r == "node" and self.node_clients)]
        return {self.publics[role] for role in roles} | (set(self.node_clients.values())
                                                         if "node" in SENDERS[self.role] else set())

    def key_names(self) -> dict[str, str]:
        """A message's ZAP User-Id (its sender's Z85 public key) -> the sender: a role, or a
        cache node's id for that node's ``node_clients`` key. Readers build it once."""
        return ({key.decode(): role for role, key in self.publics.items()}
                | {key.decode(): nid for nid, key in self.node_clients.items()})

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server with this role's key (before it binds); the context's
        authenticator (``start_authenticator``) admits only ``allowed()`` clients."""
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def connect_to(self, sock: zmq.Socket, server_role: str) -> None:
        """Make ``sock`` a CURVE client of a ``server_role`` socket (before it connects)."""
        own = self.client or self.keys
        sock.curve_secretkey = own.secret
        sock.curve_publickey = own.public
        sock.curve_serverkey = self.publics[server_role]

    def start_authenticator(self, context: zmq.asyncio.Context) -> zmq.auth.asyncio.AsyncioAuthenticator:
        """The ZAP handler of ``context`` (on the running event loop): CURVE clients whose public
        key is in ``allowed()``, nobody else. Stop it before destroying the context."""
        auth = zmq.auth.asyncio.AsyncioAuthenticator(context)
        auth.start()
        auth.configure_curve_callback("*", _AllowList(self.allowed()))
        return auth


class _AllowList:
    """ZAP credentials provider: a fixed set of Z85 public keys."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


@dataclass(frozen=True)
class DataPlaneKeys:
    """A deployment's key pairs, one per role (made by the launcher at start)."""

    pairs: dict[str, KeyPair]
    node_clients: dict[str, KeyPair] = field(default_factory=dict)
    """node id -> that cache node's own client key pair (``Security.client``)."""

    @classmethod
    def generate(cls, node_ids: tuple[str, ...] = ()) -> DataPlaneKeys:
        return cls({role: KeyPair.generate() for role in ROLES}, {nid: KeyPair.generate() for nid in node_ids})

    def security(self, role: str, host: str = LOOPBACK, node_id: str = "") -> Security:
        """``role``'s identity: its own key pair and every role's public key; a node's own
        client pair (``node_id``), a gateway's map of every node's client key.

        Raises:
            ValueError: an unknown role, or a ``node_id`` without a key pair.
        """
        if role not in self.pairs:
            raise ValueError(f"unknown data-plane role {role!r}; known roles: {list(ROLES)}")
        if node_id and node_id not in self.node_clients:
            raise ValueError(f"no data-plane key pair for node {node_id!r}")
        client = self.node_clients[node_id] if node_id else None
        nodes = {nid: p.public for nid, p in self.node_clients.items()} if role == "gateway" else {}
        return Security(role, self.pairs[role], {r: p.public for r, p in self.pairs.items()}, host, client, nodes)


def secure_push(security: Security | None, server_role: str) -> Any:
    """A ``connect`` hook for ``data_plane.PushSockets``: CURVE client of ``server_role``."""
    if security is None:
        return None
    return lambda sock: security.connect_to(sock, server_role)
