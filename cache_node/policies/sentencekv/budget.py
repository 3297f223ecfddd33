"""SentenceKV's accounting (mixed into ``SentenceKV``): how the budget divides into pool slots,
sentence index and recall region (all in token-equivalent bytes: one token's K/V in every layer
at the pool's dtype), the host-tier slots a demotion reserves, and the bytes the engine charges
for what the policy holds outside the pool blocks (device index and region, private host RAM).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from cache_node.kv_pool import KVPool
from cache_node.policies.quant import channel_group
from cache_node.policies.sentencekv.bound import KeyBounds
from cache_node.policies.sentencekv.host_kv import PrivateHostKV, TierHostKV
from cache_node.policies.sentencekv.region import SentenceCodes
from cache_node.policies.sentencekv.store import HostSentenceStore

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV


class SentenceBudget:
    """Accounting methods of ``SentenceKV`` (its fields and ``Policy.budget_tokens``)."""

    sink_tokens: int
    window_tokens: int
    evict_every: int
    region_bits: int
    region_group: int
    headroom_blocks: int
    bound_tier: str
    recall_eps: float

    if TYPE_CHECKING:
        def budget_tokens(self, num_prompt_tokens: int) -> int: ...

    def _bound_device_bytes(self, state: SequenceKV) -> int:
        bounds = state.extra.get("key_bounds")
        return bounds.nbytes if bounds is not None and self._bounds_at == "device" else 0

    def pool_tokens(self, state: SequenceKV) -> int:
        """Pool slots the sequence may fill after a compaction: sinks and window in whole
        blocks, plus ``headroom_blocks`` blocks that decoding fills before the next demotion."""
        bs = state.pool.block_size
        return (math.ceil((self.sink_tokens + self.window_tokens) / bs) + self.headroom_blocks) * bs

    @staticmethod
    def _token_bytes(state: SequenceKV) -> int:
        """Bytes of one token's K/V in every layer at the pool's dtype (the budget's unit)."""
        pool = state.pool
        return KVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.kv.dtype)

    def index_tokens(self, state: SequenceKV, store: HostSentenceStore) -> int:
        """The sentence index's device bytes, in tokens (a token = its K/V in every layer)."""
        return math.ceil((store.index_nbytes + self._bound_device_bytes(state)) / self._token_bytes(state))

    def region_slot_bytes(self, state: SequenceKV) -> int:
        """Device bytes of one region slot in every layer and KV head: the pool dtype's K/V,
        or with ``region_bits`` the codes plus a float16 scale and zero per channel group."""
        pool = state.pool
        if not self.region_bits:
            return self._token_bytes(state)
        d = pool.head_dim
        per_head = d * self.region_bits // 8 + 2 * 2 * (d // self._region_group(state))
        return pool.num_layers * 2 * pool.num_kv_heads * per_head

    def _region_group(self, state: SequenceKV) -> int:
        return channel_group(self.region_group, state.pool.head_dim)

    def region_tokens(self, state: SequenceKV, store: HostSentenceStore) -> int:
        """R, per layer and KV head: the slots that fit in the budget left after the pool slots
        and the index, so peak device bytes stay within the budget."""
        assert state.budget is not None
        left = max(0, state.budget - self.index_tokens(state, store) - self.pool_tokens(state))
        return left * self._token_bytes(state) // self.region_slot_bytes(state)

    def _host_slots(self, state: SequenceKV, store: HostSentenceStore, runs: list[torch.Tensor]) -> int:
        """Host-tier slots that demoting the sentences ``runs`` (index runs, as ``segments``)
        reserves (``TierHostKV.add``): their K/V, and the region codes and host-side key
        bounds charged beside them, sized from one token's codes and one sentence's bounds."""
        host = store.host
        assert isinstance(host, TierHostKV)
        n = sum(len(run) for run in runs)
        extra = n * self._codes_token_bytes(state)
        if self._bounds_at == "host":
            pool = state.pool
            bounds = KeyBounds("cpu")
            bounds.append(torch.zeros((pool.num_layers, 1, pool.num_kv_heads, pool.head_dim), dtype=pool.kv.dtype),
                          0, self.region_bits, self._region_group(state))
            extra += len(runs) * bounds.nbytes
        return host.slots_for(n, extra)

    def _codes_token_bytes(self, state: SequenceKV) -> int:
        """Host bytes of one demoted token's region codes (``SentenceCodes``; 0 without
        ``region_bits``)."""
        if not self.region_bits:
            return 0
        pool = state.pool
        one = torch.zeros((pool.num_layers, 1, 2, pool.num_kv_heads, pool.head_dim), dtype=pool.kv.dtype)
        return SentenceCodes.nbytes_of(SentenceCodes(self.region_bits, self._region_group(state)).quantize(one))

    def min_charge_tokens(self, state: SequenceKV, num_tokens: int) -> int:
        """Without a host tier (``state.host`` None) the demoted sentences' K/V and region
        codes sit in the sequence's own RAM, charged to the pool (``private_host_bytes``): at
        least every token past what the policy keeps (its budget and ``evict_every`` slack),
        each a pool token's bytes plus its codes; beside the recall region and the sentence
        index, charged too, which fill the budget left after the pool slots
        (``region_tokens``). With a host tier, 0 (the tier holds the sentences)."""
        budget = self.budget_tokens(state.seq.num_prompt_tokens)
        demoted = max(0, num_tokens - budget - self.evict_every - 1)
        if state.host is not None or not demoted:
            return 0
        token_bytes = self._token_bytes(state)
        sentences = math.ceil(demoted * (token_bytes + self._codes_token_bytes(state)) / token_bytes)
        return sentences + max(0, budget - self.pool_tokens(state))

    @property
    def _bounds_at(self) -> str:
        """``bound_tier`` with ``"auto"`` resolved: host in exact-recall mode, else off."""
        if self.bound_tier == "auto":
            return "host" if self.recall_eps else "off"
        return self.bound_tier

    def host_slots(self, state: SequenceKV) -> int:
        store = state.extra.get("sentences")
        return 0 if store is None else store.host.num_held_slots

    def private_host_bytes(self, state: SequenceKV) -> int:
        """Without a host tier the demoted sentences' K/V, their region codes and host-side key
        bounds sit in the sequence's own CPU tensors, which no tier budget counts (with one,
        the host tier's slots hold and charge them: ``TierHostKV``; key bounds it had no room
        for count here)."""
        store = state.extra.get("sentences")
        if store is None:
            return 0
        uncharged = state.extra.get("bounds_uncharged", 0)
        if not isinstance(store.host, PrivateHostKV):
            return uncharged
        bounds = state.extra.get("key_bounds")
        host_bounds = bounds.nbytes if bounds is not None and self._bounds_at == "host" else 0
        return store.host.nbytes + (0 if store.codes is None else store.codes.nbytes) + host_bounds

    def extra_device_bytes(self, state: SequenceKV) -> int:
        """The sentence index plus the recall region (every slot counts, filled or not), plus
        the key bounds with ``bound_tier="device"``. The exact-recall overflow is not counted
        (transient, one layer at a time: ``device_bytes_peak`` in the stats)."""
        store = state.extra.get("sentences")
        if store is None:
            return 0
        return store.index_nbytes + store.region_nbytes + self._bound_device_bytes(state)
