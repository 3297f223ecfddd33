"""Compiled grammars kept by (cache namespace, kind, spec), bounded by entries and bytes, and specs
that failed.

Every key names the cache namespace of the requests it serves (``Key``; ``grammars.grammar_key``),
so a grammar is shared exactly as prefix KV is: by the requests of one namespace (salt included),
never across namespaces, except ``json_object``'s, which carries nothing of a tenant's. A
tenant cannot tell from a request's latency (a kept grammar, or a compile it joins) which specs
another tenant sent, nor whether a deleted tenant did (``GrammarCache.forget``,
``FailedSpecs.forget``). Regression (review 30b F1): keyed by (kind, spec) alone, a 60-property
schema another tenant had used answered in ~140 ms against ~1 s for one nobody had.

``GrammarCache`` is a map of compiled grammars, at most ``max_entries``, and at most
``max_bytes`` counting each grammar's ``memory_size_bytes`` plus its key's texts (a grammar
larger than the whole budget is used by its requests but not kept), fair per tenant: each
tenant that put or got an entry holds a claim on it, kept in that tenant's own
least-recently-used order, and is charged the entry's full bytes and one entry for it (an entry
several tenants use counts for each of them). Past either bound, the tenant charged the most in
that bound (entries or bytes) gives up its least recently used claim; an entry is dropped when
no tenant claims it any more. So a tenant filling the cache evicts its own grammars first, and
another tenant's grammar stays while that tenant holds no more than its share. Regression
(review 27c F2): one shared LRU, which one tenant flushed in 1.9 s with 256 trivial regexes.

``FailedSpecs``: a spec whose compilation failed (it does not compile, ran past the time limit,
or the compiler process died on it) is remembered with its message for ``ttl_s``, per tenant
(each tenant whose request waited on that compile), so the same tenant sending it again is
refused at once instead of costing the compiler another full time limit; at most
``max_per_tenant`` per tenant (its oldest out first) and ``max_total`` in all (the tenant
holding the most gives up its oldest). Another tenant's identical spec is compiled (in its own
queue turn): a failure that depends on the moment (a time limit passed on a loaded host, a
compiler that died) is not visited on a tenant whose request did not meet it, and no tenant's
flood of failing specs flushes another tenant's memory of its own. Regression: one list for
all tenants, 256 entries, oldest out first: one tenant's 256 cheap failing regexes let another
tenant's slow spec compile again to its limit, and a spec that timed out for one tenant was
refused to every tenant for 60 s.

Not thread-safe: ``Grammars`` holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from cache_node.tiers.fair_lru import holder_of

Key = tuple[str, str, str]
"""(cache namespace, kind, spec): the namespace of the requests it serves ("" for ``json_object``)."""


def in_holder(key: Key, holder: str) -> bool:
    """Whether ``key``'s namespace is ``holder`` or one of its salted variants."""
    return bool(key[0]) and holder_of(key[0]) == holder


def grammar_bytes(key: Key, compiled: Any) -> int:
    """What a kept grammar costs: xgrammar's ``memory_size_bytes`` and its key's text."""
    return int(compiled.memory_size_bytes) + sum(len(part) for part in key)


class GrammarCache:
    """Args:
        max_entries: most compiled grammars kept.
        max_bytes: most bytes of compiled grammars kept (``grammar_bytes``).
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._kept: dict[Key, tuple[Any, int, set[str]]] = {}  # key -> (grammar, bytes, claiming tenants)
        self._claims: dict[str, OrderedDict[Key, None]] = {}  # tenant -> its claims, least recent first
        self._tenant_bytes: dict[str, int] = {}  # tenant -> bytes of the entries it claims
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def held(self, tenant: str) -> tuple[int, int]:
        """What ``tenant`` is charged: (entries, bytes) it claims."""
        return len(self._claims.get(tenant, ())), self._tenant_bytes.get(tenant, 0)

    def get(self, key: Key, tenant: str = "") -> Any | None:
        """The kept grammar of ``key`` (now ``tenant``'s most recently used), or None."""
        entry = self._kept.get(key)
        if entry is None:
            return None
        self._claim(tenant, key, entry)
        return entry[0]

    def put(self, key: Key, compiled: Any, tenants: Iterable[str] = ("",)) -> bool:
        """Keep ``compiled``, claimed by each of ``tenants`` (the most recently used of each),
        then give up claims past either bound (the most charged tenant's least recently used
        first). False when it is not kept: alone over ``max_bytes``, or its claims given up."""
        size = grammar_bytes(key, compiled)
        if size > self.max_bytes:
            return False
        before = self._kept.get(key)
        tenants = [*(before[2] if before is not None else ()), *tenants]  # its claims stay
        self._drop(key)
        entry = self._kept[key] = (compiled, size, set())
        self.num_bytes += size
        for tenant in tenants:
            self._claim(tenant, key, entry)
        if not entry[2]:
            self._drop(key)
            return False
        while len(self._kept) > self.max_entries or self.num_bytes > self.max_bytes:
            if len(self._kept) > self.max_entries:
                victim = max(self._claims, key=lambda t: len(self._claims[t]))
            else:
                victim = max(self._claims, key=self._tenant_bytes.__getitem__)
            self._unclaim(victim, next(iter(self._claims[victim])))
        return key in self._kept

    def forget(self, tenant: str, holder: str) -> int:
        """``tenant`` was deleted and ``holder`` was its own namespace: drop every entry of that
        namespace (salted variants too), and give up ``tenant``'s claims on the others (an
        entry it alone claimed goes). Returns the entries dropped."""
        before = len(self._kept)
        for key in [k for k in self._kept if in_holder(k, holder)]:
            self._drop(key)
        for key in list(self._claims.get(tenant, ())):
            self._unclaim(tenant, key)
        return before - len(self._kept)

    def _claim(self, tenant: str, key: Key, entry: tuple[Any, int, set[str]]) -> None:
        claims = self._claims.setdefault(tenant, OrderedDict())
        if key in claims:
            claims.move_to_end(key)
            return
        claims[key] = None
        entry[2].add(tenant)
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + entry[1]

    def _unclaim(self, tenant: str, key: Key) -> None:
        """``tenant`` gives up ``key``; the entry is dropped once no tenant claims it."""
        claims = self._claims[tenant]
        del claims[key]
        entry = self._kept[key]
        entry[2].discard(tenant)
        self._tenant_bytes[tenant] -= entry[1]
        if not claims:
            del self._claims[tenant], self._tenant_bytes[tenant]
        if not entry[2]:
            del self._kept[key]
            self.num_bytes -= entry[1]

    def _drop(self, key: Key) -> None:
        entry = self._kept.get(key)
        if entry is not None:
            for tenant in list(entry[2]):
                self._unclaim(tenant, key)
            if key in self._kept:  # claimed by no tenant
                del self._kept[key]
                self.num_bytes -= entry[1]

    def check_integrity(self) -> None:
        """``num_bytes`` is the sum of the kept entries' bytes, within both bounds; every entry
        is claimed, and each tenant's claims and bytes match the entries'."""
        total = sum(size for _, size, _ in self._kept.values())
        for key, (_, _, tenants) in self._kept.items():
            if not tenants or any(key not in self._claims.get(t, ()) for t in tenants):
                raise AssertionError(f"grammar cache entry {key[1]} claimed by {sorted(tenants)} inconsistently")
        for tenant, claims in self._claims.items():
            if not claims or any(key not in self._kept or tenant not in self._kept[key][2] for key in claims) \
                    or sum(self._kept[key][1] for key in claims) != self._tenant_bytes.get(tenant):
                raise AssertionError(f"grammar cache charges tenant {tenant!r} inconsistently")
        if total != self.num_bytes:
            raise AssertionError(f"grammar cache counts {self.num_bytes} bytes, its entries hold {total}")
        if total > self.max_bytes or len(self._kept) > self.max_entries:
            raise AssertionError(f"grammar cache past its bounds: {len(self._kept)} entries, {total} bytes")


class FailedSpecs:
    """Specs whose compile failed, per tenant, for a while (the module's docstring).

    Args:
        max_per_tenant: most failed specs remembered for one tenant.
        max_total: most remembered for all tenants together.
        ttl_s: how long a failed spec is refused to its tenant without compiling (0: never).
    """

    def __init__(self, max_per_tenant: int, max_total: int, ttl_s: float) -> None:
        self.max_per_tenant, self.max_total, self.ttl_s = max_per_tenant, max_total, ttl_s
        self._by_tenant: dict[str, OrderedDict[Key, tuple[float, str]]] = {}  # oldest first: (until, message)
        self.num_entries = 0

    def held(self, tenant: str) -> int:
        """Failed specs remembered for ``tenant`` (expired ones included until looked up or pushed out)."""
        return len(self._by_tenant.get(tenant, ()))

    def failed(self, key: Key, tenant: str, now: float) -> str | None:
        """The message of ``key``'s failure for ``tenant`` within the last ``ttl_s``, else None."""
        entries = self._by_tenant.get(tenant)
        entry = entries.get(key) if entries is not None else None
        if entry is None:
            return None
        if entry[0] <= now:
            self._forget(tenant, key)
            return None
        return entry[1]

    def put(self, key: Key, tenants: Iterable[str], message: str, now: float) -> None:
        """Remember that ``key`` failed with ``message`` for each of ``tenants`` (those whose
        requests waited on the compile) until ``now + ttl_s``, then give up the oldest past
        either bound (a tenant's own first; in all, the tenant holding the most)."""
        if self.ttl_s <= 0:
            return
        for tenant in tenants:
            entries = self._by_tenant.setdefault(tenant, OrderedDict())
            self.num_entries -= entries.pop(key, None) is not None
            entries[key] = (now + self.ttl_s, message)
            self.num_entries += 1
            while len(entries) > self.max_per_tenant:
                self._forget(tenant, next(iter(entries)))
        while self.num_entries > self.max_total:
            victim = max(self._by_tenant, key=lambda t: len(self._by_tenant[t]))
            self._forget(victim, next(iter(self._by_tenant[victim])))

    def forget(self, tenant: str, holder: str) -> None:
        """``tenant`` was deleted and ``holder`` was its own namespace: forget its failed specs,
        and any of that namespace (salted variants too) remembered for another tenant."""
        for name in list(self._by_tenant):
            for key in [k for k in self._by_tenant[name] if name == tenant or in_holder(k, holder)]:
                self._forget(name, key)

    def _forget(self, tenant: str, key: Key) -> None:
        entries = self._by_tenant[tenant]
        del entries[key]
        self.num_entries -= 1
        if not entries:
            del self._by_tenant[tenant]
