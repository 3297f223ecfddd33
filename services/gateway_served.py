"""Where a gateway actor last served, kept by the gateway itself in Ray's cluster key-value
store (the GCS): ``ServedRecord``. A restarted ``RayGateway`` serves again on the scheduler's
record of it (``GlobalScheduler.gateway_addresses``); this one answers when the scheduler has
none (it was restarted and rebuilt its state without this gateway, or lost it otherwise), and
tells that case apart from a gateway that never served (restarted before its first ``start``).
A gateway stopped for good (``stop_services``, a failed start's ``_kill_placed``, ``kvstrata down``)
has its record deleted (``forget``), by its actor id: other gateways' records on the cluster stay.
One that died on its own for good (its restarts used up, its node lost) is pruned at the next
start of any gateway on the cluster (``prune_dead``: records whose actor Ray lists DEAD).

Regression (s39): such a gateway's record stayed until the Ray cluster stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from typing import Any, Protocol

from ray.experimental import internal_kv

NAMESPACE = "kvstrata"
"""The GCS key-value namespace of the records (each key is ``gateway_served/<actor id>``)."""

log = logging.getLogger(__name__)

KEY_PREFIX = b"gateway_served/"

PRUNE_PAGE = 1024
"""Records ``prune_dead`` reads the actor states of (one GCS read each) before it deletes the
dead ones among them and goes on with the next page."""

_ACTOR_ID = re.compile(rb"[0-9a-f]{32}")
"""A Ray actor id as ``record_key`` writes it (16 bytes, lower-case hex)."""

API_NAMES = ("grpc", "http", "metrics")
"""The addresses a record holds, each ``host:port`` or "" (not served)."""


class KeyValues(Protocol):
    """A store of bytes under bytes keys that outlives the gateway's process."""

    def put(self, key: bytes, value: bytes) -> None: ...

    def get(self, key: bytes) -> bytes | None: ...

    def delete(self, key: bytes) -> None: ...

    def list_keys(self, prefix: bytes) -> list[bytes]: ...


class GcsKeyValues:
    """Ray's GCS key-value store (``ray.experimental.internal_kv``), in ``NAMESPACE``: it lives as
    long as the Ray cluster, through any actor's restarts. Blocking calls (one GCS round trip)."""

    def put(self, key: bytes, value: bytes) -> None:
        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)

    def get(self, key: bytes) -> bytes | None:
        return internal_kv._internal_kv_get(key, namespace=NAMESPACE)

    def delete(self, key: bytes) -> None:
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)

    def list_keys(self, prefix: bytes) -> list[bytes]:
        return list(internal_kv._internal_kv_list(prefix, namespace=NAMESPACE))


def record_key(gateway_id: str) -> bytes:
    """The key of the record of the gateway actor ``gateway_id`` (its Ray actor id, hex)."""
    return KEY_PREFIX + gateway_id.encode()


def forget(gateway: Any, store: KeyValues | None = None) -> None:
    """Delete the record of ``gateway`` (its actor handle), stopped for good: that key alone,
    never a prefix (another deployment's gateways on the cluster keep theirs). Blocking (one GCS
    round trip); nothing when it has none. Raises the store's error.

    Regression (s38): no path deleted a record, so each stopped gateway's stayed in the GCS for
    the cluster's life (a joined cluster's ``up``/``down`` cycles added one each)."""
    (store if store is not None else GcsKeyValues()).delete(record_key(gateway._actor_id.hex()))


def actor_state(actor_id: str) -> str:
    """Ray's state of actor ``actor_id`` (hex): "ALIVE", "RESTARTING", "DEAD", ... or "" when
    Ray has no record of it (another cluster's, or evicted). One GCS read; raises its error."""
    from ray._private import state  # no public API reads one actor's state without the dashboard

    return str(state.actors(actor_id).get("State", ""))


def prune_dead(store: KeyValues | None = None, state_of: Callable[[str], str] | None = None,
               page_size: int = PRUNE_PAGE) -> list[str]:
    """Delete the records of gateway actors Ray lists DEAD (dead for good: no restart of theirs
    will read it); returns their ids. A record stays whose actor is alive or restarting, that
    Ray has no record of (unknown is not dead: another cluster's actor, or an entry evicted),
    whose state could not be read (logged), or whose key is no ``gateway_served/<actor id>``
    (not ours to judge). Blocking: one GCS list, then every record, ``page_size`` at a time: one
    read each (``state_of``: None for ``actor_state``), then the page's dead ones deleted.
    Raises the store's error (the list or a delete: the pages before it stay pruned).

    Regression (s40): only the first 1024 records listed were looked at, so with that many
    alive, unknown or unreadable ones listed first, a dead gateway's record behind them was
    never pruned."""
    store = store if store is not None else GcsKeyValues()
    state_of = state_of if state_of is not None else actor_state
    keys = store.list_keys(KEY_PREFIX)
    pruned: list[str] = []
    for start in range(0, len(keys), page_size):
        dead = [key for key in keys[start:start + page_size] if _is_dead(key, state_of)]
        for key in dead:
            store.delete(key)
            pruned.append(key[len(KEY_PREFIX):].decode())
    if pruned:
        log.info("deleted the served-address records of %d gateways Ray lists dead: %s", len(pruned),
                 ", ".join(pruned[:10]))
    return pruned


def _is_dead(key: bytes, state_of: Callable[[str], str]) -> bool:
    """Whether ``key`` is a ``gateway_served/<actor id>`` record whose actor Ray lists DEAD
    (a state that cannot be read is unknown: False, logged)."""
    actor_id = key[len(KEY_PREFIX):] if isinstance(key, bytes) and key.startswith(KEY_PREFIX) else b""
    if not _ACTOR_ID.fullmatch(actor_id):
        return False
    try:
        return state_of(actor_id.decode()) == "DEAD"
    except Exception as exc:  # noqa: BLE001 - unknown: kept, tried again at the next start
        log.warning("gateway record %r: its actor's state is unknown (kept): %s", key, exc)
        return False


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
