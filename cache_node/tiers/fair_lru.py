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
node from the puts it is sent (``check_put_weight``); a shared namespace weighs the sum of its
tenants' weights (each the latest known; one not heard of for ``TENANT_WEIGHT_TTL_S`` lapses).
A holder with no known weight counts as weight 1, the default tenant's; a holder weighs at most
``MAX_HOLDER_WEIGHT``. A cache node's spill put carries at most ``PUT_TENANTS`` of a holder's
tenants' weights, in turns (``HolderWeights.put_weight``), so a spill node weighs a holder of
more tenants by those whose turn came within ``TENANT_WEIGHT_TTL_S``. A changed weight applies from the next eviction on: nothing is evicted when it
changes, but a holder whose weight fell gives way to the others' inserts until it is back at
its share.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Generic, NamedTuple, TypeVar

K = TypeVar("K")
V = TypeVar("V")

_NEWEST = 1 << 62  # the recency stamp of an incoming unit: newer than every entry
SALT_SEPARATOR = "#"  # ``salted_namespace``: "<namespace>#salt=<salt>"; namespaces hold no "#"


MAX_HOLDER_WEIGHTS = 65536
"""Weights one ``HolderWeights`` remembers, of holders and tenants (the least recently set
forgotten first: such a holder counts as weight 1 again until its weight is set anew)."""

TENANT_WEIGHT_TTL_S = 600.0
"""How long a tenant's weight counts for its namespace's holder after it was last set (a request
of the tenant's on a cache node, a spill put carrying it)."""

MAX_PUT_TENANTS = 1024
"""Most tenants' weights one spill put may carry for its holder (``check_put_weight``)."""

PUT_TENANTS = 32
"""Most tenants' weights a cache node's spill put carries (``HolderWeights.put_weight``): a
holder of more tenants sends them in turns, this many per put. Regression (review R3 F4, s36):
every put carried all of them, so a shared namespace of more than ``MAX_PUT_TENANTS`` tenants
could never spill (every put refused), and a put of 1024 weights cost ~22 ms instead of ~0.5."""

MAX_HOLDER_WEIGHT = 1e9
"""Most a holder weighs: its tenants' summed weights are capped here (review R3 F6, s36: two
finite weights near the largest float summed to inf, and the fair shares' ``held / weight`` to 0
whatever the holder held)."""

MAX_TENANT_CHARS = 256
"""Longest tenant id a spill put's weights may name."""


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


def check_put_weight(weight: object) -> float | dict[str, float]:
    """A spill put's ``weight`` (it comes off the network): a holder's weight as a whole
    (``check_weight``), or each of its tenants' (``HolderWeights.tenants``): a dict of at most
    ``MAX_PUT_TENANTS`` tenant ids (non-empty text of at most ``MAX_TENANT_CHARS`` characters)
    to weights ``check_weight`` accepts.

    Raises:
        ValueError: anything else, naming ``weight``.
    """
    if not isinstance(weight, dict):
        return check_weight(weight)
    if not 0 < len(weight) <= MAX_PUT_TENANTS:
        raise ValueError(f"weight: a put's tenants' weights must name 1 to {MAX_PUT_TENANTS} tenants, "
                         f"got {len(weight)}")
    out: dict[str, float] = {}
    for tenant, w in weight.items():
        if type(tenant) is not str or not 0 < len(tenant) <= MAX_TENANT_CHARS:
            raise ValueError(f"weight: a tenant id must be text of 1 to {MAX_TENANT_CHARS} characters, "
                             f"got {type(tenant).__name__} {str(tenant)[:40]!r}")
        out[tenant] = check_weight(w)
    return out


class HolderWeights:
    """The weight of each holder: the sum of the latest known weights of the tenants naming it
    (``set`` with a ``tenant``), or the latest weight set for it as a whole (``set`` without
    one); a holder never set (or forgotten) weighs 1.

    A shared namespace is one holder for every tenant naming it, so it weighs what its tenants
    weigh together: they share their shares, as each would hold its own in a namespace of its
    own. Regression (s36 fault 3): the holder took the weight of the latest request or spill
    put naming it, so the share of a weight-3 tenant sharing a namespace with a weight-1 one
    flipped with whoever sent last: after a put of the weight-1 tenant's, a third tenant of
    weight 1 took half of a full tier instead of a fifth. A tenant's entry follows it: set for
    another holder (its spec names another namespace) it leaves the old one; it lapses after
    ``ttl_s`` without a ``set`` while another tenant's entry for the holder is newer (a deleted
    or idle tenant no longer weighs for a shared namespace others use; the most recently set
    entry always counts, so a tenant's own namespace keeps its weight however idle).

    Bounded: at most ``max_holders`` entries (holders set as a whole, and tenants), the least
    recently set forgotten first. Setting is O(1); reading O(1), but O(tenants of the holder)
    once one of them may have lapsed; a ``FairLRU`` reads it at each eviction, so a change applies
    from the next one. Reads may run on another thread than writes (``_lock``).

    Args:
        max_holders: most entries kept.
        ttl_s: how long a tenant's entry counts after its last ``set``.
        clock: seconds, monotonic (``time.monotonic``).
    """

    def __init__(self, max_holders: int = MAX_HOLDER_WEIGHTS, ttl_s: float = TENANT_WEIGHT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_holders < 1:
            raise ValueError(f"max_holders must be >= 1, got {max_holders}")
        self.max_holders, self.ttl_s, self._clock = max_holders, ttl_s, clock
        self._lock = threading.Lock()
        # (holder, tenant) -> (weight, when set); tenant "": the holder set as a whole. Oldest first
        self._entries: OrderedDict[tuple[str, str], tuple[float, float]] = OrderedDict()
        self._tenants: dict[str, dict[str, None]] = {}  # holder -> its entries' tenants
        self._holder_of: dict[str, str] = {}  # tenant -> the holder its entry is for
        self._sums: dict[str, tuple[float, float]] = {}  # holder -> (weight, until when it holds)
        self._put_turns: dict[str, int] = {}  # holder -> its next put's first tenant (put_weight)

    def set(self, holder: str, weight: object, tenant: str = "") -> None:
        """Record ``tenant``'s weight for ``holder`` (it leaves the holder it was set for
        before), or without a ``tenant`` ``holder``'s weight as a whole (its tenants' entries
        dropped; weight 1 is then remembered as nothing). Raises ValueError for a weight
        ``check_weight`` refuses."""
        value = check_weight(weight)
        now = self._clock()
        with self._lock:
            if not tenant:
                for name in list(self._tenants.get(holder, ())):
                    self._drop(holder, name)
                self._drop(holder, "")
                if value != 1.0:  # what an unknown holder weighs: nothing to remember
                    self._add(holder, "", value, now)
                return
            key = (holder, tenant)
            entry = self._entries.get(key)
            if entry is not None and entry[0] == value:
                # a refresh (a request, a spill put's weights): the sum stays, its entries only lapse
                # later, so the cached sum holds until its own end (review R3 F4: every put's weights
                # summed the holder's tenants anew)
                self._entries[key] = (value, now)
                self._entries.move_to_end(key)
                return
            old = self._holder_of.get(tenant)
            if old is not None:
                self._drop(old, tenant)
            self._drop(holder, "")
            self._add(holder, tenant, value, now)

    def merge(self, holder: str, weights: Mapping[str, object]) -> None:
        """``set(holder, weight, tenant)`` for each tenant's weight in ``weights`` (what a spill
        put carries: ``tenants``). Raises ValueError, nothing set, for a weight refused."""
        checked = {tenant: check_weight(w) for tenant, w in weights.items()}
        for tenant, w in checked.items():
            self.set(holder, w, tenant)

    def of(self, holder: str) -> float:
        """``holder``'s weight (1.0 when unknown; at most ``MAX_HOLDER_WEIGHT``)."""
        now = self._clock()
        cached = self._sums.get(holder)
        if cached is not None and now < cached[1]:
            return cached[0]
        if cached is None and holder not in self._tenants:
            return 1.0
        with self._lock:
            return self._sum(holder, now)

    def tenants(self, holder: str) -> dict[str, float]:
        """The weights of ``holder``'s tenants whose entries have not lapsed ({} when it was set
        as a whole or is unknown)."""
        now = self._clock()
        with self._lock:
            self._sum(holder, now)  # drops the lapsed ones
            return {t: self._entries[(holder, t)][0] for t in self._tenants.get(holder, ()) if t}

    def put_weight(self, holder: str) -> float | dict[str, float]:
        """What a spill put of ``holder``'s blocks carries (``check_put_weight`` accepts it): its
        tenants' weights (``tenants``), at most ``PUT_TENANTS`` of them, the next ones in turn at
        each call while it has more; ``of(holder)`` when none is known (set as a whole, or
        unknown). O(``PUT_TENANTS``) but for skipping to its turn (C speed) and a sum whose
        cache ended."""
        now = self._clock()
        with self._lock:
            cached = self._sums.get(holder)  # none lapsed before its end: no sum to redo
            weight = cached[0] if cached is not None and now < cached[1] else self._sum(holder, now)
            tenants = self._tenants.get(holder, {})
            if not tenants or "" in tenants:  # unknown, or set as a whole (then it has no tenants)
                return weight
            if len(tenants) <= PUT_TENANTS:
                names = list(tenants)
            else:
                start = self._put_turns.pop(holder, 0) % len(tenants)
                # the least recently put first: trimmed first
                self._put_turns[holder] = (start + PUT_TENANTS) % len(tenants)
                names = list(islice(tenants, start, start + PUT_TENANTS))
                names += list(islice(tenants, 0, PUT_TENANTS - len(names)))
                while len(self._put_turns) > self.max_holders:
                    del self._put_turns[next(iter(self._put_turns))]
            return {t: self._entries[(holder, t)][0] for t in names}

    def forget(self, holder: str) -> None:
        """Drop ``holder``'s weight and its tenants' entries (a deleted tenant's namespace)."""
        with self._lock:
            for name in list(self._tenants.get(holder, ())):
                self._drop(holder, name)
            self._put_turns.pop(holder, None)

    def forget_tenant(self, tenant: str) -> None:
        """Drop ``tenant``'s entry, whichever holder it is for (its tenant was deleted): a
        shared namespace's holder weighs its other tenants alone from now on."""
        with self._lock:
            holder = self._holder_of.get(tenant)
            if holder is not None:
                self._drop(holder, tenant)

    def known(self) -> dict[str, float]:
        """The weights other than 1 that are remembered, per holder (its tenants' sum)."""
        now = self._clock()
        with self._lock:
            sums = {holder: self._sum(holder, now) for holder in list(self._tenants)}
        return {holder: weight for holder, weight in sums.items() if weight != 1.0}

    def _add(self, holder: str, tenant: str, value: float, now: float) -> None:
        self._entries[(holder, tenant)] = (value, now)
        self._entries.move_to_end((holder, tenant))
        self._tenants.setdefault(holder, {})[tenant] = None
        if tenant:
            self._holder_of[tenant] = holder
        self._sums.pop(holder, None)
        while len(self._entries) > self.max_holders:
            (old_holder, old_tenant), _ = next(iter(self._entries.items()))
            self._drop(old_holder, old_tenant)

    def _drop(self, holder: str, tenant: str) -> None:
        if self._entries.pop((holder, tenant), None) is None:
            return
        names = self._tenants.get(holder)
        if names is not None:
            names.pop(tenant, None)
            if not names:
                del self._tenants[holder]
        if tenant and self._holder_of.get(tenant) == holder:
            del self._holder_of[tenant]
        self._sums.pop(holder, None)

    def _sum(self, holder: str, now: float) -> float:
        """``holder``'s weight now, its lapsed tenants' entries dropped (all but one most
        recently set, which always counts, even when others were set at the same clock value);
        cached until the next one lapses. Under ``_lock``."""
        names = list(self._tenants.get(holder, ()))
        # one entry, not every one set at the newest time: with a coarse clock several share it,
        # and counting them all as newest cached the sum for good, so none of them ever lapsed
        # (review s36 R4 N1)
        newest = max(names, key=lambda name: self._entries[(holder, name)][1], default=None)
        total, until = 0.0, math.inf
        for name in names:
            value, at = self._entries[(holder, name)]
            if name and name != newest:
                if now - at >= self.ttl_s:
                    self._drop(holder, name)
                    continue
                until = min(until, at + self.ttl_s)
            total += value
        weight = min(total, MAX_HOLDER_WEIGHT) if total > 0 else 1.0
        self._sums[holder] = (weight, until)
        return weight


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
