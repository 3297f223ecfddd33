"""Per-tenant fair eviction for the tiers below the device: the largest holder per weight goes first.

The device tier divides blocks by tenant quota (``scheduling.base.TenantShare.kv_quota_blocks``);
the host tier, the spill RAM tier and the spill disk tier have no quotas, and a plain LRU over
all tenants lets one tenant that streams new prefixes push every other tenant's cached KV out
(a cross-tenant reach: their next prefix hit becomes a recompute).

``FairLRU`` keeps one LRU order per *holder* and evicts from the holder that holds the most per
unit of its weight (``held / weight``, in entries or bytes), least recently used first within
it; ties go to the holder whose LRU entry is oldest. While one holder is alone it may fill the
whole tier (work-conserving); once others hold entries, a holder over its weighted share evicts
only its own, and a holder at or under the largest holding per weight keeps what it has: the
weighted max-min fair split of a shared cache among its users (the allocation FairRide studies:
Pu et al., "FairRide: Near-Optimal, Fair Cache Sharing", NSDI 2016, §2; weighted as the
schedulers' virtual token counters weight service: ``scheduling.vtc``), with LRU inside each
user's share. Two holders of weights 3 and 1 filling a tier end at 3:1 of it.

A holder is a block's cache namespace without its salt (``holder_of``): a tenant's own
namespace, or a shared namespace that the tenants naming it share by their own choice. A
per-request ``cache_salt`` (``services.gateway_inputs.salted_namespace``) therefore never gives a
tenant extra shares.

A holder's weight is its tenant's ``weight`` (``tenants.model.TenantSpec``), the latest one known
where the tier runs (``HolderWeights``): a cache node learns it from the requests it runs, a spill
node from the puts it is sent (``check_weight``); a shared namespace takes the weight of the
latest request naming it. A holder with no known weight counts as weight 1, the default
tenant's. A changed weight applies from the next eviction on: nothing is evicted when it
changes, but a holder whose weight fell gives way to the others' inserts until it is back at
its share.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

K = TypeVar("K")
V = TypeVar("V")

_NEWEST = 1 << 62  # the recency stamp of an incoming unit: newer than every entry
SALT_SEPARATOR = "#"  # ``salted_namespace``: "<namespace>#salt=<salt>"; namespaces hold no "#"


MAX_HOLDER_WEIGHTS = 65536
"""Holders whose weight one ``HolderWeights`` remembers (the least recently set forgotten first:
such a holder counts as weight 1 again until its weight is set anew)."""


def holder_of(namespace: str) -> str:
    """The holder a block of ``namespace`` counts against: the namespace without its salt."""
    return namespace.partition(SALT_SEPARATOR)[0]


def check_weight(weight: object) -> float:
    """``weight`` as a holder's weight: a positive finite number, as a tenant spec's ``weight``
    (``tenants.model.TenantSpec``). It may come off the network (a spill put's).

    Raises:
        ValueError: a bool, a non-number, NaN, an infinity, zero or a negative number.
    """
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
            or weight <= 0:
        raise ValueError(f"weight must be a positive finite number (a tenant's weight), got {weight!r}")
    return float(weight)


class HolderWeights:
    """The latest known weight of each holder; a holder never set (or forgotten) weighs 1.

    Bounded: at most ``max_holders`` weights, the least recently set forgotten first. Setting
    and reading are O(1); a ``FairLRU`` reads it at each eviction, so a change applies from the
    next one. Reads may run on another thread than writes (single dict operations).
    """

    def __init__(self, max_holders: int = MAX_HOLDER_WEIGHTS) -> None:
        if max_holders < 1:
            raise ValueError(f"max_holders must be >= 1, got {max_holders}")
        self.max_holders = max_holders
        self._weights: OrderedDict[str, float] = OrderedDict()

    def set(self, holder: str, weight: object) -> None:
        """Record ``holder``'s weight. Raises ValueError for a weight ``check_weight`` refuses."""
        value = check_weight(weight)
        if value == 1.0:  # what an unknown holder weighs: nothing to remember
            self._weights.pop(holder, None)
            return
        self._weights[holder] = value  # replaced in place: a reader never sees it missing
        self._weights.move_to_end(holder)
        while len(self._weights) > self.max_holders:
            self._weights.popitem(last=False)

    def of(self, holder: str) -> float:
        """``holder``'s weight (1.0 when unknown)."""
        return self._weights.get(holder, 1.0)

    def forget(self, holder: str) -> None:
        """Drop ``holder``'s weight (a deleted tenant's namespace)."""
        self._weights.pop(holder, None)

    def known(self) -> dict[str, float]:
        """The weights other than 1 that are remembered, per holder."""
        return dict(self._weights)


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
    """A keyed store with per-holder LRU orders and largest-holder-per-weight-first eviction.

    ``victims(need)`` names the keys to drop to free ``need`` size units (entries or bytes);
    the caller pops them. Every operation but ``victims`` is O(1); ``victims`` is
    O(k x holders) for k victims.

    Args:
        weights: each holder's weight (shared with the other stores of a tier and whoever
            learns the weights); None: every holder weighs 1 (unweighted max-min fairness).
    """

    def __init__(self, weights: HolderWeights | None = None) -> None:
        self.weights = weights if weights is not None else HolderWeights()
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

    def share(self, holder: str, held: float) -> float:
        """``held`` size units of ``holder`` per unit of its weight: what eviction compares."""
        return held / self.weights.of(holder)

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
        the least recently used entry of the holder then holding the most per weight
        (``held / weight``; ties: the holder whose LRU entry is oldest). Nothing is removed."""
        return self.plan(need).keys

    def plan(self, need: int, incoming: Mapping[str, int] | None = None,
             pinned: Mapping[str, int] | None = None) -> Eviction[K]:
        """``victims`` with units about to be inserted: ``incoming`` (holder -> units of size 1)
        counts toward its holder's holding as that holder's newest entries, and a pick of one
        is counted in ``Eviction.refused`` (that unit should not go in). So an inserting
        holder over the others' holdings per weight displaces its own, never theirs.
        ``pinned`` (holder -> size) counts toward a holder's holding too but is never picked:
        room the holder keeps outside the LRU orders (the host tier's ``reserve``d slots).
        Nothing is removed.
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
        weight = {h: self.weights.of(h) for h in heads}  # read once: a change applies next time
        out = Eviction[K]([], {})
        freed = 0
        while freed < need and heads:
            holder = max(heads, key=lambda h: (held[h] / weight[h], -heads[h][0]))
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
