"""Client addresses as the gateway counts them: a gRPC peer string's client network
(``peer_network``), and an HTTP client's address written as gRPC writes a peer (``grpc_peer``),
so the gRPC and HTTP front ends share one authenticator and one set of per-network limits.
"""

from __future__ import annotations

import ipaddress
import urllib.parse


def peer_network(peer: str) -> str:
    """The client network a gRPC peer string counts under: its IPv4 address (an IPv4-mapped
    IPv6 address counts as its IPv4 one), its IPv6 /64 (one host commonly holds a whole /64),
    the string itself otherwise (``unix:``, unparsable).

    Regression (review of ddf59ab, R4): grpc writes an IPv6 peer percent-encoded
    (``ipv6:%5B::1%5D:47808``), which was not decoded: each IPv6 connection, port included,
    counted as a network of its own, and one host filled the gateway-wide caps."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    host = rest.rpartition(":")[0] if kind in ("ipv4", "ipv6") else ""
    host = host.strip("[]").split("%", 1)[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return peer
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.version == 6:
        return f"ipv6:{ipaddress.ip_network(f'{address}/64', strict=False)}"
    return f"ipv4:{address}"


def grpc_peer(host: str, port: int) -> str:
    """An HTTP client's ``host`` and ``port`` in gRPC's peer form: ``ipv4:10.0.0.1:53412``,
    ``ipv6:[2001:db8::1]:53412``; a host that is not an IP address (a Unix socket's path) as
    ``unix:<host>``."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return f"unix:{host}"
    return f"ipv4:{address}:{port}" if address.version == 4 else f"ipv6:[{address}]:{port}"
