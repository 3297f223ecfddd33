"""Where a gateway actor last served, kept by the gateway itself in Ray's cluster key-value
store (the GCS): ``ServedRecord``. A restarted ``RayGateway`` serves again on the scheduler's
record of it (``GlobalScheduler.gateway_addresses``); this one answers when the scheduler has
none (it was restarted and rebuilt its state without this gateway, or lost it otherwise), and
tells that case apart from a gateway that never served (restarted before its first ``start``).
A gateway stopped for good (``stop_services``, a failed start's ``_kill_placed``, ``kvstrata down``)
has its record deleted (``forget``), by its actor id: other gateways' records on the cluster stay.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from ray.experimental import internal_kv

NAMESPACE = "kvstrata"
"""The GCS key-value namespace of the records (each key is ``gateway_served/<actor id>``)."""

API_NAMES = ("grpc", "http", "metrics")
"""The addresses a record holds, each ``host:port`` or "" (not served)."""


class KeyValues(Protocol):
    """A store of bytes under bytes keys that outlives the gateway's process."""

    def put(self, key: bytes, value: bytes) -> None: ...

    def get(self, key: bytes) -> bytes | None: ...

    def delete(self, key: bytes) -> None: ...


class GcsKeyValues:
    """Ray's GCS key-value store (``ray.experimental.internal_kv``), in ``NAMESPACE``: it lives as
    long as the Ray cluster, through any actor's restarts. Blocking calls (one GCS round trip)."""

    def put(self, key: bytes, value: bytes) -> None:
        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)

    def get(self, key: bytes) -> bytes | None:
        return internal_kv._internal_kv_get(key, namespace=NAMESPACE)

    def delete(self, key: bytes) -> None:
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)


def record_key(gateway_id: str) -> bytes:
    """The key of the record of the gateway actor ``gateway_id`` (its Ray actor id, hex)."""
    return f"gateway_served/{gateway_id}".encode()


def forget(gateway: Any, store: KeyValues | None = None) -> None:
    """Delete the record of ``gateway`` (its actor handle), stopped for good: that key alone,
    never a prefix (another deployment's gateways on the cluster keep theirs). Blocking (one GCS
    round trip); nothing when it has none. Raises the store's error.

    Regression (s38): no path deleted a record, so each stopped gateway's stayed in the GCS for
    the cluster's life (a joined cluster's ``up``/``down`` cycles added one each)."""
    (store if store is not None else GcsKeyValues()).delete(record_key(gateway._actor_id.hex()))


class ServedRecord:
    """The gRPC, HTTP and ``/metrics`` addresses of the gateway actor ``gateway_id``, as it last
    served them (``save`` after each start that attached to the scheduler)."""

    def __init__(self, gateway_id: str, store: KeyValues | None = None) -> None:
        self.key = record_key(gateway_id)
        self.store = store if store is not None else GcsKeyValues()

    async def save(self, addresses: dict[str, str]) -> None:
        """Keep ``addresses`` (``API_NAMES`` -> ``host:port`` or ""), replacing the last ones.
        Runs in a worker thread (a GCS round trip). Raises the store's error."""
        value = json.dumps({name: addresses.get(name, "") for name in API_NAMES}).encode()
        await asyncio.to_thread(self.store.put, self.key, value)

    async def load(self) -> dict[str, str]:
        """The addresses ``save`` kept last (``API_NAMES`` -> ``host:port`` or ""), every one ""
        when none were kept (this gateway never served). Raises the store's error, or
        ValueError for a record that is not one ``save`` wrote."""
        value = await asyncio.to_thread(self.store.get, self.key)
        if value is None:
            return dict.fromkeys(API_NAMES, "")
        record: Any = json.loads(value)
        if not isinstance(record, dict) or not all(isinstance(record.get(n), str) for n in API_NAMES):
            raise ValueError(f"the served-address record {self.key.decode()!r} is malformed")
        return {name: record[name] for name in API_NAMES}
