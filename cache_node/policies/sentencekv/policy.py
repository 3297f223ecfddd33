"""The SentenceKV policy (registered as ``sentencekv``): demote all but sinks and window to host
RAM sentence by sentence, and before each layer attends recall per KV head the sentences the
query points at. The design, budget and sources are in the package docstring."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cache_node.attention_stats import StatsNeeds
from cache_node.compaction import can_rewrite, gather_kv
from cache_node.kv_pool import KVPool
from cache_node.policies.base import Policy, protected_mask
from cache_node.policies.registry import register
from cache_node.policies.sentencekv.host_kv import PrivateHostKV, TierHostKV
from cache_node.policies.sentencekv.region import QuantSentenceRegion, SentenceCodes, SentenceRegion
from cache_node.policies.sentencekv.shortlist import head_scores, shortlist
from cache_node.policies.sentencekv.sketch import KeySketch
from cache_node.policies.sentencekv.store import HostSentenceStore

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV


@register
@dataclass
class SentenceKV(Policy):
    """See the package docstring (``cache_node.policies.sentencekv``).

    Keys a query attends: while the prompt is prefilled, every earlier token. Once the pool
    part, region and index exceed the budget (+ ``evict_every``), every token but positions
    ``0 .. sink_tokens - 1`` and the ``window_tokens`` most recent is demoted (``window_tokens``
    0: all but the sinks); a query at position ``p`` then attends the kept tokens, the tokens
    computed since, and, per KV head, the demoted sentences recalled into that head's ``R``
    region slots for this step (all earlier than ``p``).

    ``max_sentence_tokens`` splits run-on sentences;
    ``sketch_bits``/``sketch_group`` size the key sketch (``select_mode="sketch"``);
    ``region_bits``/``region_group`` the recall region's codes (0: the pool's dtype).

    Raises:
        ValueError: an unknown ``select_mode``, ``sketch_bits`` or ``region_bits``, or
            ``cold_bits`` set (sentencekv demotes to host RAM).
    """

    name = "sentencekv"
    needs = StatsNeeds(window_queries=16)
    window_tokens: int = 16
    max_sentence_tokens: int = 48
    select_mode: str = "sketch"
    last_query_share: float = 0.5
    sketch_bits: int = 2
    sketch_group: int = 16
    region_bits: int = 8
    region_group: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.select_mode not in ("sketch", "cos", "mass", "mean"):
            raise ValueError(f"unknown select_mode {self.select_mode!r}; known: sketch, cos, mass, mean")
        if self.cold_bits:
            raise ValueError("sentencekv demotes to host RAM; cold_bits does not apply")
        if self.sketch_bits not in (1, 2, 4, 8):
            raise ValueError(f"sketch_bits must be 1, 2, 4 or 8, got {self.sketch_bits}")
        if self.region_bits not in (0, 4, 8):
            raise ValueError(f"region_bits must be 0 (the pool's dtype), 4 or 8, got {self.region_bits}")

    # ---- segmentation and demotion ---------------------------------------------------------
    def segments(self, state: SequenceKV, positions: torch.Tensor) -> list[torch.Tensor]:
        """Split ascending ``positions`` into sentences (index runs into ``positions``)."""
        tokens = state.seq.all_token_ids
        ends = state.env.sentence_end_token_ids
        out, start = [], 0
        for i, p in enumerate(positions.tolist()):
            if tokens[p] in ends or i + 1 - start >= self.max_sentence_tokens or i + 1 == len(positions):
                out.append(torch.arange(start, i + 1, device=positions.device))
                start = i + 1
        return out

    def _store(self, state: SequenceKV) -> HostSentenceStore:
        store = state.extra.get("sentences")
        if store is None:
            sketch = KeySketch(self.sketch_bits, self.sketch_group) if self.select_mode == "sketch" else None
            host = PrivateHostKV() if state.host is None else TierHostKV(state.host)
            store = state.extra["sentences"] = HostSentenceStore(host, sketch)
            if self.region_bits:
                store.codes = SentenceCodes(self.region_bits, self._region_group(state))
        return store

    def pool_tokens(self, state: SequenceKV) -> int:
        """Pool slots the sequence may fill after a compaction: sinks and window in whole
        blocks, plus one block of headroom that decoding fills before the next demotion."""
        bs = state.pool.block_size
        return (math.ceil((self.sink_tokens + self.window_tokens) / bs) + 1) * bs

    @staticmethod
    def _token_bytes(state: SequenceKV) -> int:
        """Bytes of one token's K/V in every layer at the pool's dtype (the budget's unit)."""
        pool = state.pool
        return KVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.kv.dtype)

    def index_tokens(self, state: SequenceKV, store: HostSentenceStore) -> int:
        """The sentence index's device bytes, in tokens (a token = its K/V in every layer)."""
        return math.ceil(store.index_nbytes / self._token_bytes(state))

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
        return min(self.region_group, state.pool.head_dim)

    def region_tokens(self, state: SequenceKV, store: HostSentenceStore) -> int:
        """R, per layer and KV head: the slots that fit in the budget left after the pool slots
        and the index, so peak device bytes stay within the budget."""
        assert state.budget is not None
        left = max(0, state.budget - self.index_tokens(state, store) - self.pool_tokens(state))
        return left * self._token_bytes(state) // self.region_slot_bytes(state)

    def compress(self, state: SequenceKV) -> bool:
        assert state.budget is not None
        store = self._store(state)
        bs = state.pool.block_size
        region = math.ceil(store.region_nbytes / self._token_bytes(state))
        held = math.ceil((state.frontier + 1) / bs) * bs + region + self.index_tokens(state, store)
        if held <= state.budget + self.evict_every:
            return False  # the next token's block, the region and the index still fit
        pos0 = state.positions[0]  # identical in all layers, no holes
        kept_mask = protected_mask(pos0, self.sink_tokens, self.window_tokens)
        demote, keep = (~kept_mask).nonzero().squeeze(1), kept_mask.nonzero().squeeze(1)
        if not len(demote):
            return False  # only sinks and window: nothing to demote
        L = state.pool.num_layers
        if not can_rewrite(state.block_pool, state.seq, len(keep), bs):
            return False
        for run in self.segments(state, pos0[demote]):
            slots = demote[run]
            store.put(gather_kv(state.pool, state.seq, slots.unsqueeze(0).expand(L, -1)), pos0[slots])
        kept = gather_kv(state.pool, state.seq, keep.unsqueeze(0).expand(L, -1))
        positions = pos0[keep].expand(L, -1).clone()
        state.set_layout(kept, positions, torch.ones(positions.shape, device=positions.device))
        store.resize_region(self.region_tokens(state, store), state.pool.kv, self.region_bits,
                            self._region_group(state))
        if state.stats is not None:
            state.stats.compact([keep] * L)
        self._fill_from_window(state)
        return True

    def _fill_from_window(self, state: SequenceKV) -> None:
        stats = state.stats
        for layer in range(state.pool.num_layers):
            q = None if stats is None else stats.queries[layer]
            if q is not None:
                self.recall(state, layer, q)

    # ---- promotion at decode ----------------------------------------------------------------
    def before_attend(self, state: SequenceKV, layer_idx: int, q: torch.Tensor, q_pos: torch.Tensor) -> None:
        store = state.extra.get("sentences")
        if store is not None and store.region_tokens:
            self.recall(state, layer_idx, q)

    def extra_kv(self, state: SequenceKV, layer_idx: int) -> SentenceRegion | QuantSentenceRegion | None:
        store = state.extra.get("sentences")
        if store is None or not store.region_tokens:
            return None
        if self.region_bits:
            return QuantSentenceRegion(store, layer_idx, self.region_bits)
        return SentenceRegion(store, layer_idx)

    def scores(self, state: SequenceKV, store: HostSentenceStore, layer_idx: int, q: torch.Tensor
               ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Per-head sentence scores for the queries ``q`` (n, H, d): a list of (H_kv, S') — the
        chunk's last query's first when ``last_query_share`` applies — and the shortlist the
        S' columns index (None: all sentences)."""
        last_first = q.shape[0] > 1 and self.last_query_share > 0
        queries = [q[-1:], q] if last_first else [q]
        if store.sketch is not None:  # one pass over the codes; the last query's row is its score
            mass = store.sketch.log_mass(layer_idx, q, state.scaling, len(store))  # (n, H_kv, g, S)
            parts = [mass[-1:], mass] if last_first else [mass]
            return [m.amax(dim=(0, 2)) for m in parts], None
        assert store.mean_keys is not None
        mk = store.mean_keys[:, layer_idx].view(len(store), state.pool.num_kv_heads, -1)  # (S, H_kv, d)
        lengths = torch.tensor([len(p) for p in store.positions], device=mk.device)
        cand = shortlist(mk, q, store.region_tokens)
        if cand is not None:
            mk, lengths = mk[cand], lengths[cand]
        return [head_scores(mk, x, self.select_mode, state.scaling, lengths) for x in queries], cand

    def recall(self, state: SequenceKV, layer_idx: int, q: torch.Tensor) -> None:
        """Promote the sentences ``q`` (n, H, d) points at into the layer's recall region,
        each KV head its own."""
        store = self._store(state)
        r = store.region_tokens
        if r == 0 or not len(store):
            return
        scores, cand = self.scores(state, store, layer_idx, q)
        chosen = self.select(store, scores, r, cand)
        before = store.resident.get(layer_idx)
        if before == chosen:
            return
        t0 = time.perf_counter()
        changed = [h for h, sids in enumerate(chosen) if before is None or before[h] != sids]
        self._load(store, layer_idx, changed, chosen)
        store.resident[layer_idx] = chosen
        store.recall_s += time.perf_counter() - t0
        store.num_recalls += 1

    def select(self, store: HostSentenceStore, scores: list[torch.Tensor], r: int,
               cand: torch.Tensor | None = None) -> tuple[tuple[int, ...], ...]:
        """Per KV head, the sentences that fit that head's ``r`` slots, best first, returned in
        position order. With two score sets (the chunk's last query, then all its queries),
        the first may fill ``last_query_share`` of ``r``.
        ``scores``: list of (H_kv, S) over all sentences, or over the shortlist ``cand``."""
        lengths, first, _, _ = store.flat()
        caps = [int(self.last_query_share * r), r] if len(scores) == 2 else [r]
        ranked = []  # per score set, per head: sentence ids best first (one argsort and tolist)
        for sc in scores:
            order = sc.argsort(dim=-1, descending=True)
            ranked.append((order if cand is None else cand[order]).tolist())
        out = []
        for head in range(len(ranked[0])):
            chosen: dict[int, None] = {}
            used = 0
            for order, cap in zip(ranked, caps):
                for sid in order[head]:
                    if used >= cap:
                        break
                    if sid not in chosen and used + lengths[sid] <= cap:
                        chosen[sid] = None
                        used += lengths[sid]
            out.append(tuple(sorted(chosen, key=first.__getitem__)))
        return tuple(out)

    def _load(self, store: HostSentenceStore, layer: int, heads: list[int],
              chosen: tuple[tuple[int, ...], ...]) -> None:
        """Copy the sentences ``chosen[h]`` of every KV head ``h`` in ``heads`` from host RAM
        into that head's region slots (one gather and scatter: ``HostSentenceStore.load_region``)."""
        store.load_region(layer, chosen, heads)

    def release(self, state: SequenceKV) -> None:
        store = state.extra.get("sentences")
        if store is not None:
            store.host.release()

    # ---- accounting -------------------------------------------------------------------------
    def private_host_bytes(self, state: SequenceKV) -> int:
        """Without a host tier the demoted sentences' K/V and their region codes sit in the
        sequence's own CPU tensors, which no tier budget counts (with one, the host tier's
        slots hold and charge them: ``TierHostKV``)."""
        store = state.extra.get("sentences")
        if store is None or not isinstance(store.host, PrivateHostKV):
            return 0
        return store.host.nbytes + (0 if store.codes is None else store.codes.nbytes)

    def extra_device_bytes(self, state: SequenceKV) -> int:
        """The sentence index plus the recall region (every slot counts, filled or not)."""
        store = state.extra.get("sentences")
        if store is None:
            return 0
        return store.index_nbytes + store.region_nbytes
