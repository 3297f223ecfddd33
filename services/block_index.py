"""The global block index: which holder keeps each block hash, and in which tier.

Holders are cache nodes (tiers ``device`` and ``host``) and spill nodes (``spill_ram`` and
``spill_disk``). Both push batches of ``(event, block_hash, tier)`` changes
(docs/architecture.md, 'Tiers'); the index is eventually consistent: an event may arrive
after a request was admitted, so every answer is an estimate, and the node's own prefix cache
(token-checked) decides.

The index keeps one ``(holder, tier)`` pair per copy, so the order of events inside a batch
does not matter for a move: a demotion (removed/device, stored/host) and a promotion
(stored/device, removed/host) both end with exactly one pair. Chained hashes make every
match a prefix walk that stops at the first miss.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

TIER_DEVICE = "device"
TIER_HOST = "host"
SPILL_TIERS = ("spill_ram", "spill_disk")
TIERS = (TIER_DEVICE, TIER_HOST, *SPILL_TIERS)  # the same names as cache_node.tiers.manager.TIERS
NODE_TIERS = (TIER_DEVICE, TIER_HOST)
EVENTS = ("stored", "removed")


class PrefixTiers(NamedTuple):
    """Leading blocks of a prompt a cache node can reuse, by where they are (blocks)."""

    device: int = 0
    host: int = 0
    spill: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.spill


class BlockIndex:
    """Block hash -> set of ``(holder_id, tier)`` pairs, with pair counts per tier and per
    holder."""

    def __init__(self) -> None:
        self._pairs: dict[bytes, set[tuple[str, str]]] = {}
        self._per_tier: Counter[str] = Counter()
        self._per_holder: Counter[str] = Counter()

    def __len__(self) -> int:
        """Distinct block hashes held anywhere."""
        return len(self._pairs)

    def holders(self, block_hash: bytes) -> set[tuple[str, str]]:
        """The ``(holder_id, tier)`` pairs holding ``block_hash`` (a copy; empty when none)."""
        return set(self._pairs.get(block_hash, ()))

    def apply(self, holder_id: str, events: Iterable[Sequence[object]]) -> int:
        """Apply ``(event, block_hash)`` (tier "device") or ``(event, block_hash, tier)`` items.

        Storing a pair already held and removing one not held are no-ops (an event may
        arrive after ``clear``). Returns the number of events applied.

        Raises:
            ValueError: an unknown event or tier, a malformed item, or an empty
                ``holder_id``. TypeError: a block hash that is not bytes. The index is
                unchanged when either is raised.
        """
        if not holder_id:
            raise ValueError("holder_id must be non-empty")
        checked = [_check(item) for item in events]
        for kind, block_hash, tier in checked:
            if kind == "stored":
                self._add(block_hash, (holder_id, tier))
            else:
                self._discard(block_hash, (holder_id, tier))
        return len(checked)

    def pairs_of(self, holder_id: str) -> int:
        """The ``(holder_id, tier)`` pairs held: the blocks ``holder_id`` holds, a block in two
        of its tiers counted twice."""
        return self._per_holder[holder_id]

    def pairs_after(self, holder_id: str, events: Iterable[tuple[str, bytes, str]], reset: bool = False) -> int:
        """``pairs_of(holder_id)`` once ``events`` (checked ``(event, block_hash, tier)``
        triples) were applied, after a ``forget`` with ``reset``; the index is not changed.
        O(len(events))."""
        present: dict[tuple[bytes, str], bool] = {}
        count = 0 if reset else self._per_holder[holder_id]
        for kind, block_hash, tier in events:
            key = (block_hash, tier)
            held = present.get(key)
            if held is None:
                held = not reset and (holder_id, tier) in self._pairs.get(block_hash, ())
            present[key] = kind == "stored"
            count += present[key] - held
        return count

    def forget(self, holder_id: str) -> int:
        """Drop every pair of ``holder_id`` (a restarted holder re-reports). Returns pairs
        dropped; O(indexed blocks), nothing for a holder that holds none."""
        if not self._per_holder[holder_id]:
            return 0
        dropped = 0
        for block_hash in list(self._pairs):
            for pair in [p for p in self._pairs[block_hash] if p[0] == holder_id]:
                self._discard(block_hash, pair)
                dropped += 1
        return dropped

    def clear(self) -> None:
        self._pairs.clear()
        self._per_tier.clear()
        self._per_holder.clear()

    def pairs_per_tier(self) -> dict[str, int]:
        """Block copies per tier, summed over holders (every tier of ``TIERS`` present)."""
        return {tier: self._per_tier[tier] for tier in TIERS}

    def node_prefix(self, node_id: str, hashes: Sequence[bytes]) -> int:
        """Leading ``hashes`` that cache node ``node_id`` holds on device or in its host tier."""
        n = 0
        for block_hash in hashes:
            pairs = self._pairs.get(block_hash, ())
            if (node_id, TIER_DEVICE) not in pairs and (node_id, TIER_HOST) not in pairs:
                break
            n += 1
        return n

    def prefix_tiers(self, node_id: str, hashes: Sequence[bytes]) -> PrefixTiers:
        """Leading ``hashes`` reusable by ``node_id``, each counted in its cheapest tier.

        A block counts as device or host when ``node_id`` holds it there, else as spill
        when any spill node holds it (spill nodes serve every cache node); the walk stops
        at the first block found nowhere.
        """
        counts = {TIER_DEVICE: 0, TIER_HOST: 0, "spill": 0}
        for block_hash in hashes:
            pairs = self._pairs.get(block_hash, ())
            if (node_id, TIER_DEVICE) in pairs:
                counts[TIER_DEVICE] += 1
            elif (node_id, TIER_HOST) in pairs:
                counts[TIER_HOST] += 1
            elif any(tier in SPILL_TIERS for _, tier in pairs):
                counts["spill"] += 1
            else:
                break
        return PrefixTiers(counts[TIER_DEVICE], counts[TIER_HOST], counts["spill"])

    def check_integrity(self) -> None:
        """Raise RuntimeError when the per-tier or per-holder counts disagree with the pairs,
        or a hash is kept with no pair (a removal that did not clean up)."""
        actual: Counter[str] = Counter(tier for pairs in self._pairs.values() for _, tier in pairs)
        if any(not pairs for pairs in self._pairs.values()):
            raise RuntimeError("block index keeps a hash that no holder has")
        if dict(actual) != {tier: n for tier, n in self._per_tier.items() if n}:
            raise RuntimeError(f"per-tier counts {dict(self._per_tier)} != pairs {dict(actual)}")
        holders = Counter(holder for pairs in self._pairs.values() for holder, _ in pairs)
        if +holders != +self._per_holder:
            raise RuntimeError(f"per-holder counts {dict(self._per_holder)} != pairs {dict(holders)}")

    def _add(self, block_hash: bytes, pair: tuple[str, str]) -> None:
        pairs = self._pairs.setdefault(block_hash, set())
        if pair not in pairs:
            pairs.add(pair)
            self._per_tier[pair[1]] += 1
            self._per_holder[pair[0]] += 1

    def _discard(self, block_hash: bytes, pair: tuple[str, str]) -> None:
        pairs = self._pairs.get(block_hash)
        if pairs is None or pair not in pairs:
            return
        pairs.remove(pair)
        self._per_tier[pair[1]] -= 1
        self._per_holder[pair[0]] -= 1
        if not self._per_holder[pair[0]]:
            del self._per_holder[pair[0]]
        if not pairs:
            del self._pairs[block_hash]


def _check(item: Sequence[object]) -> tuple[str, bytes, str]:
    """``(event, block_hash[, tier])`` as a typed triple; raises ValueError (TypeError for a
    hash that is not bytes) when malformed."""
    if len(item) not in (2, 3):
        raise ValueError(f"an event is (event, block_hash[, tier]), got {item!r}")
    kind, block_hash = item[0], item[1]
    tier = item[2] if len(item) == 3 else TIER_DEVICE
    if kind not in EVENTS:
        raise ValueError(f"unknown event {kind!r}; known: {list(EVENTS)}")
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; known: {list(TIERS)}")
    if not isinstance(block_hash, bytes):
        raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    return str(kind), block_hash, str(tier)


MAX_PREFIX_PROMPTS = 32_768
"""Prompts the common-prefix statistic keeps, all tenants' (each at most 64 eight-byte hash
prefixes: under 20 MB in all)."""

MAX_PREFIX_GROUPS_PER_TENANT = 16
"""Namespaces (first blocks) one tenant's prompts keep a common-prefix window for."""

HASH_PREFIX_BYTES = 8
"""Bytes of each chained hash ``CommonPrefix`` keeps (a collision only merges two of one
tenant's own prefixes in its own statistic)."""


class _Window:
    """One group's recent prompts (each its hash prefixes joined) and its memoized statistic."""

    def __init__(self, window: int) -> None:
        self.prompts: deque[bytes] = deque(maxlen=window)
        self.since = 0  # observations since ``blocks`` was last computed
        self.blocks: int | None = None  # None: compute at the next ``blocks_for``


class CommonPrefix:
    """How many leading blocks a tenant's recent prompts in one namespace share (a system
    prompt, a chat template).

    Routing by prefix affinity only pays when a match goes past what nearly every request
    shares anyway; otherwise every request would pile onto whichever node served that shared
    prefix first. A group is one tenant's prompts that start with the same block (the first
    chained hash covers the cache namespace); each group keeps the first ``max_blocks`` hashes
    of its last ``window`` prompts. Since the k-th chained hash names the whole k-block
    prefix, its common prefix is the largest k whose most frequent k-th hash appears in at
    least ``share`` of them, and 0 until ``min_prompts`` were seen (a handful of prompts share
    everything with themselves). Recomputed when asked after every ``refresh`` observations of
    the group (O(window x max_blocks)).

    Bounded: a tenant keeps its ``groups_per_tenant`` most recently observed groups, and all
    groups together at most ``max_prompts`` prompts; past that the tenant keeping the most
    prompts gives up the oldest of its least recently observed group. So one tenant's traffic
    never changes another tenant's statistic while that one keeps no more than an even share.

    Regressions (security reviews): one statistic over every tenant's prompts let one tenant's
    64 prompts sharing a 20-block prefix switch prefix-affinity routing off for every other
    tenant; then one window of 256 prompts shared by every namespace let one tenant's 256
    prompts push another's out, its statistic fell to 0 and its requests sharing a system
    prompt all went to the one node holding it (10/10 over two nodes became 20/0).

    Raises:
        ValueError: ``window``, ``max_blocks``, ``refresh`` or ``groups_per_tenant`` < 1,
            ``share`` not in (0, 1], ``min_prompts`` > ``window``, ``max_prompts`` < ``window``.
    """

    def __init__(self, window: int = 256, share: float = 0.5, max_blocks: int = 64, refresh: int = 16,
                 min_prompts: int = 64, groups_per_tenant: int = MAX_PREFIX_GROUPS_PER_TENANT,
                 max_prompts: int = MAX_PREFIX_PROMPTS) -> None:
        if (window < 1 or max_blocks < 1 or refresh < 1 or not 0.0 < share <= 1.0 or min_prompts > window
                or groups_per_tenant < 1 or max_prompts < window):
            raise ValueError(f"bad CommonPrefix settings: window={window}, share={share}, "
                             f"max_blocks={max_blocks}, refresh={refresh}, min_prompts={min_prompts}, "
                             f"groups_per_tenant={groups_per_tenant}, max_prompts={max_prompts}")
        self.window, self.share, self.max_blocks, self.refresh = window, share, max_blocks, refresh
        self.min_prompts, self.groups_per_tenant, self.max_prompts = min_prompts, groups_per_tenant, max_prompts
        self._groups: dict[str, OrderedDict[bytes, _Window]] = {}  # tenant -> first hash -> window
        self._kept: Counter[str] = Counter()  # prompts kept per tenant
        self.prompts = 0  # prompts kept in all

    def observe(self, block_hashes: Sequence[bytes], tenant_id: str = "") -> None:
        """Record one of ``tenant_id``'s prompts by its chained block hashes ([] = unknown,
        ignored)."""
        if not block_hashes:
            return
        groups = self._groups.setdefault(tenant_id, OrderedDict())
        group = groups.get(block_hashes[0])
        if group is None:
            group = groups[block_hashes[0]] = _Window(self.window)
            if len(groups) > self.groups_per_tenant:
                self._drop_oldest(tenant_id, len(groups[next(iter(groups))].prompts))
        groups.move_to_end(block_hashes[0])
        if len(group.prompts) == self.window:
            self._count(tenant_id, -1)  # the deque drops its oldest
        group.prompts.append(b"".join(h[:HASH_PREFIX_BYTES] for h in block_hashes[: self.max_blocks]))
        self._count(tenant_id, 1)
        group.since += 1
        if group.since >= self.refresh:
            group.since, group.blocks = 0, None
        while self.prompts > self.max_prompts:
            self._drop_oldest(max(self._kept, key=self._kept.__getitem__), 1)

    def blocks_for(self, block_hashes: Sequence[bytes], tenant_id: str = "") -> int:
        """Leading blocks shared by at least ``share`` of ``tenant_id``'s recent prompts that
        start with the same block as ``block_hashes``; 0 until ``min_prompts`` of them were seen,
        and for an unknown group. Memoized until the group's next refresh."""
        groups = self._groups.get(tenant_id)
        group = groups.get(block_hashes[0]) if groups is not None and block_hashes else None
        if group is None:
            return 0
        if group.blocks is None:
            group.blocks = self._compute(group.prompts) if len(group.prompts) >= self.min_prompts else 0
        return group.blocks

    def forget(self, tenant_id: str) -> None:
        """Drop every window of ``tenant_id`` (it was deleted); an unknown id is a no-op."""
        for group in self._groups.pop(tenant_id, {}).values():
            self._count(tenant_id, -len(group.prompts))

    def check_integrity(self) -> None:
        """Raise RuntimeError when the prompt counts disagree with the windows kept or a bound
        is passed."""
        kept = Counter({t: sum(len(g.prompts) for g in gs.values()) for t, gs in self._groups.items()})
        if +kept != +self._kept or sum(kept.values()) != self.prompts:
            raise RuntimeError(f"common-prefix counts {dict(self._kept)} != windows {dict(kept)}")
        if self.prompts > self.max_prompts or any(len(g) > self.groups_per_tenant for g in self._groups.values()):
            raise RuntimeError("common-prefix windows past their bounds")

    def _drop_oldest(self, tenant_id: str, n: int) -> None:
        """Drop the ``n`` oldest prompts of ``tenant_id``'s least recently observed group (the
        group too when that empties it)."""
        groups = self._groups[tenant_id]
        first, group = next(iter(groups.items()))
        for _ in range(min(n, len(group.prompts))):
            group.prompts.popleft()
            self._count(tenant_id, -1)
        if not group.prompts:
            del groups[first]
            if not groups:
                del self._groups[tenant_id]

    def _count(self, tenant_id: str, n: int) -> None:
        self._kept[tenant_id] += n
        self.prompts += n
        if self._kept[tenant_id] <= 0:
            del self._kept[tenant_id]

    def _compute(self, prompts: Sequence[bytes]) -> int:
        need = self.share * len(prompts)
        k = 0
        for depth in range(self.max_blocks):
            at = depth * HASH_PREFIX_BYTES
            counts = Counter(p[at: at + HASH_PREFIX_BYTES] for p in prompts if len(p) > at)
            if not counts or counts.most_common(1)[0][1] < need:
                break
            k = depth + 1
        return k
