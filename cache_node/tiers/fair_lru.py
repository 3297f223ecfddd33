"""Per-tenant fair eviction for the tiers below the device: the largest holder goes first.

The device tier divides blocks by tenant quota (``scheduling.base.TenantShare.kv_quota_blocks``);
the host tier, the spill RAM tier and the spill disk tier have no quotas, and a plain LRU over
all tenants lets one tenant that streams new prefixes push every other tenant's cached KV out
(a cross-tenant reach: their next prefix hit becomes a recompute).

``FairLRU`` keeps one LRU order per *holder* and evicts from the holder that holds the most
(in entries or bytes), least recently used first within it; ties go to the holder whose LRU
entry is oldest. While one holder is alone it may fill the whole tier (work-conserving); once
others hold entries, a holder over an equal share evicts only its own, and a holder at or under
the largest holding keeps what it has: the max-min fair split of a shared cache among its
users (the allocation FairRide studies: Pu et al., "FairRide: Near-Optimal, Fair Cache Sharing",
NSDI 2016, §2), with LRU inside each user's share.

A holder is a block's cache namespace without its salt (``holder_of``): a tenant's own
namespace, or a shared namespace that the tenants naming it share by their own choice. A
per-request ``cache_salt`` (``services.gateway_inputs.salted_namespace``) therefore never gives a
tenant extra shares.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

K = TypeVar("K")
V = TypeVar("V")

_NEWEST = 1 << 62  # the recency stamp of an incoming unit: newer than every entry
SALT_SEPARATOR = "#"  # ``salted_namespace``: "<namespace>#salt=<salt>"; namespaces hold no "#"


def holder_of(namespace: str) -> str:
    """The holder a block of ``namespace`` counts against: the namespace without its salt."""
    return namespace.partition(SALT_SEPARATOR)[0]


class Eviction(NamedTuple, Generic[K]):
    """``FairLRU.plan``'s answer: ``keys`` to evict, in order, and per holder how many of its
    incoming units were picked instead (``refused``)."""

    keys: list[K]
    refused: dict[str, int]


@dataclass
class _Item(Generic[V]):
    value: V
    size: int
    stamp: int  # recency: larger = more recently used


class FairLRU(Generic[K, V]):
    """A keyed store with per-holder LRU orders and largest-holder-first eviction.

    ``victims(need)`` names the keys to drop to free ``need`` size units (entries or bytes);
    the caller pops them. Every operation but ``victims`` is O(1); ``victims`` is
    O(k x holders) for k victims.
    """

    def __init__(self) -> None:
        self._holders: dict[str, OrderedDict[K, _Item[V]]] = {}
        self._holder_of: dict[K, str] = {}
        self._held: dict[str, int] = {}  # holder -> total size
        self._clock = 0  # stamps of touches and inserts (MRU end)
        self._low = 0  # stamps of inserts at the LRU end (``put_lru``), below every other

    def __contains__(self, key: object) -> bool:
        return key in self._holder_of

    def __len__(self) -> int:
        return len(self._holder_of)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._holder_of))

    def values(self) -> list[V]:
        """Every value, in insertion order (not eviction order)."""
        return [self[key] for key in self._holder_of]

    def __getitem__(self, key: K) -> V:
        return self._holders[self._holder_of[key]][key].value

    def get(self, key: K) -> V | None:
        holder = self._holder_of.get(key)
        return None if holder is None else self._holders[holder][key].value

    def holder(self, key: K) -> str:
        return self._holder_of[key]

    def held(self) -> dict[str, int]:
        """Size held per holder (holders holding nothing are absent)."""
        return dict(self._held)

    def put(self, key: K, value: V, holder: str, size: int = 1) -> None:
        """Insert ``key`` (absent) as its holder's most recently used entry."""
        self._clock += 1
        self._insert(key, _Item(value, size, self._clock), holder, last=True)

    def put_lru(self, key: K, value: V, holder: str, size: int = 1) -> None:
        """Insert ``key`` (absent) as older than every entry (an entry handed back unused)."""
        self._low -= 1
        self._insert(key, _Item(value, size, self._low), holder, last=False)

    def touch(self, key: K) -> None:
        """Mark ``key`` (present) most recently used."""
        entries = self._holders[self._holder_of[key]]
        self._clock += 1
        entries[key].stamp = self._clock
        entries.move_to_end(key)

    def pop(self, key: K) -> V:
        """Remove ``key`` (present) and return its value. Raises KeyError when absent."""
        holder = self._holder_of.pop(key)
        entries = self._holders[holder]
        item = entries.pop(key)
        self._held[holder] -= item.size
        if not entries:
            del self._holders[holder], self._held[holder]
        return item.value

    def clear(self) -> None:
        self._holders.clear()
        self._holder_of.clear()
        self._held.clear()

    def victims(self, need: int) -> list[K]:
        """Keys to evict, in order, until their sizes sum to ``need`` or nothing is left: each
        the least recently used entry of the holder then holding the most (ties: the holder
        whose LRU entry is oldest). Nothing is removed."""
        return self.plan(need).keys

    def plan(self, need: int, incoming: Mapping[str, int] | None = None,
             pinned: Mapping[str, int] | None = None) -> Eviction[K]:
        """``victims`` with units about to be inserted: ``incoming`` (holder -> units of size 1)
        counts toward its holder's holding as that holder's newest entries, and a pick of one
        is counted in ``Eviction.refused`` (that unit should not go in). So an inserting
        holder over the others' holdings displaces its own, never theirs. ``pinned`` (holder
        -> size) counts toward a holder's holding too but is never picked: room the holder
        keeps outside the LRU orders (the host tier's ``reserve``d slots). Nothing is removed.
        """
        if need <= 0:
            return Eviction([], {})
        held = dict(self._held)
        for holder, size in (pinned or {}).items():
            held[holder] = held.get(holder, 0) + size
        iters = {h: iter(entries.items()) for h, entries in self._holders.items()}
        heads: dict[str, tuple[int, K | None, int]] = {}  # holder -> (stamp, key, size) next
        for holder, it in iters.items():
            key, item = next(it)
            heads[holder] = (item.stamp, key, item.size)
        waiting = {h: n for h, n in (incoming or {}).items() if n > 0}
        for holder, n in waiting.items():
            held[holder] = held.get(holder, 0) + n
            heads.setdefault(holder, (_NEWEST, None, 1))
        out = Eviction[K]([], {})
        freed = 0
        while freed < need and heads:
            holder = max(heads, key=lambda h: (held[h], -heads[h][0]))
            stamp, key, size = heads[holder]
            if stamp == _NEWEST:
                out.refused[holder] = out.refused.get(holder, 0) + 1
                waiting[holder] -= 1
            else:
                out.keys.append(key)  # type: ignore[arg-type]
            freed += size
            held[holder] -= size
            following = next(iters[holder], None) if stamp != _NEWEST else None
            if following is not None:
                heads[holder] = (following[1].stamp, following[0], following[1].size)
            elif waiting.get(holder, 0) > 0:
                heads[holder] = (_NEWEST, None, 1)
            else:
                del heads[holder]
        return out

    def _insert(self, key: K, item: _Item[V], holder: str, *, last: bool) -> None:
        if key in self._holder_of:
            raise KeyError(f"{key!r} is already held")
        entries = self._holders.setdefault(holder, OrderedDict())
        entries[key] = item
        if not last:
            entries.move_to_end(key, last=False)
        self._holder_of[key] = holder
        self._held[holder] = self._held.get(holder, 0) + item.size
