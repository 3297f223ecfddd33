"""SentenceKV's recall at attention time (mixed into ``SentenceKV``): before each layer attends,
score the demoted sentences per KV head for the step's queries (on the key sketch, or on mean
keys through a shortlist), pick each head's best that fit its region slots, load the changed
heads' picks into the recall region, and hand the region (with the exact-recall overflow beside
it) to attention as extra KV. The design and sources are in the package docstring.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

from cache_node.policies.sentencekv.bound_step import step_bound
from cache_node.policies.sentencekv.overflow import ChainedKV, OverflowKV
from cache_node.policies.sentencekv.region import QuantSentenceRegion, SentenceRegion
from cache_node.policies.sentencekv.shortlist import head_scores, shortlist
from cache_node.policies.sentencekv.store import HostSentenceStore

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV

# prompt tokens per recall span while a prompt is prefilled over demoted sentences
# (``SentenceRecall.prompt_span``): a selection per 16 tokens, a decode step's recall each
PROMPT_SPAN = 16


class SentenceRecall:
    """Recall methods of ``SentenceKV`` (its fields; ``_store`` and ``deep_start`` are its own)."""

    select_mode: str
    last_query_share: float
    region_bits: int
    recall_every: int
    recall_next: int
    deep_recall_every: int
    recall_eps: float

    if TYPE_CHECKING:
        def _store(self, state: SequenceKV) -> HostSentenceStore: ...

        def deep_start(self, num_layers: int) -> int: ...

    def before_attend(self, state: SequenceKV, layer_idx: int, q: torch.Tensor, q_pos: torch.Tensor) -> None:
        store = state.extra.get("sentences")
        if store is None:
            return
        if store.region_slots(layer_idx) and not self._reuse_selection(state, store, layer_idx, q):
            self.recall(state, layer_idx, q)
        bounds = state.extra.get("key_bounds")
        state.extra.pop("overflow", None)
        if bounds is None or not len(bounds):
            return
        over = step_bound(state, store, bounds, state.extra["recall_bound"], layer_idx, q, q_pos,
                          self._region(state, layer_idx), self.recall_eps)
        if over is not None and over.num_tokens:
            state.extra["overflow"] = (layer_idx, over)
        if layer_idx == state.pool.num_layers - 1:
            state.seq.policy_stats.update(state.extra["recall_bound"].as_dict())

    def prompt_span(self, state: SequenceKV) -> int:
        """``PROMPT_SPAN`` once sentences are demoted (a session turn over its history's, a
        compressed prefix's fork, the prefix's producer past its boundary), else 0 (a first
        prompt recalls nothing). While such a prompt is prefilled, each span of its queries
        (``PROMPT_SPAN`` tokens, counted back from the prompt's end: the last span holds the
        query the first output token is sampled from, which picks first, up to
        ``last_query_share`` of the region, and the question before it) selects the sentences its tokens
        attend from its own queries (``cache_node.query_spans``; the paper's §3.3 selection
        by the current query), never one selection per scheduler chunk: the turn's output
        does not depend on how its prompt was chunked (hangs review 20 W3: five token budgets
        gave four different outputs)."""
        store = state.extra.get("sentences")
        return PROMPT_SPAN if store is not None and len(store) else 0

    def span_scope(self, state: SequenceKV, layer_idx: int) -> contextlib.AbstractContextManager[None]:
        """While a layer's spans select one after the other, the key sketch keeps the layer's
        unpacked codes (``KeySketch.held``) instead of unpacking them for every span."""
        store = state.extra.get("sentences")
        if store is None or store.sketch is None:
            return contextlib.nullcontext()
        return store.sketch.held()

    def _reuse_selection(self, state: SequenceKV, store: HostSentenceStore, layer_idx: int, q: torch.Tensor) -> bool:
        """Whether this decode step keeps the layer's last selection (``recall_every``, or
        ``deep_recall_every`` in the deep layers); a prompt's span never does."""
        every = self.deep_recall_every if layer_idx >= self.deep_start(state.pool.num_layers) else self.recall_every
        seq = state.seq
        return (every > 1 and q.shape[0] == 1 and layer_idx in store.resident
                and seq.num_computed_tokens >= seq.num_prompt_tokens and seq.num_computed_tokens % every != 0)

    def _region(self, state: SequenceKV, layer_idx: int) -> SentenceRegion | QuantSentenceRegion | None:
        store = state.extra.get("sentences")
        if store is None or not store.region_slots(layer_idx):
            return None
        if self.region_bits:
            return QuantSentenceRegion(store, layer_idx, self.region_bits)
        return SentenceRegion(store, layer_idx)

    def extra_kv(self, state: SequenceKV, layer_idx: int
                 ) -> SentenceRegion | QuantSentenceRegion | OverflowKV | ChainedKV | None:
        """The layer's recall region, and in exact-recall mode the step's overflow beside it."""
        region = self._region(state, layer_idx)
        over: tuple[int, OverflowKV] | None = state.extra.get("overflow")
        if over is None or over[0] != layer_idx:
            return region
        return over[1] if region is None else ChainedKV([region, over[1]])

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
        cand = shortlist(mk, q, store.region_slots(layer_idx))
        if cand is not None:
            mk, lengths = mk[cand], lengths[cand]
        return [head_scores(mk, x, self.select_mode, state.scaling, lengths) for x in queries], cand

    def recall(self, state: SequenceKV, layer_idx: int, q: torch.Tensor) -> None:
        """Promote the sentences ``q`` (n, H, d) points at into the layer's recall region,
        each KV head its own."""
        store = self._store(state)
        r = store.region_slots(layer_idx)
        if r == 0 or not len(store):
            return
        scores, cand = self.scores(state, store, layer_idx, q)
        chosen = self.select(store, scores, r, cand)
        before = store.resident.get(layer_idx)
        if before == chosen:
            return
        t0 = time.perf_counter()
        changed = [h for h, sids in enumerate(chosen) if before is None or before[h] != sids]
        store.load_region(layer_idx, chosen, changed, before)  # the new sentences: one gather, one scatter
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
                for sid in self._with_next(order[head], lengths, first):
                    if used >= cap:
                        break
                    if sid not in chosen and used + lengths[sid] <= cap:
                        chosen[sid] = None
                        used += lengths[sid]
            out.append(tuple(sorted(chosen, key=first.__getitem__)))
        return tuple(out)

    def _with_next(self, order: list[int], lengths: list[int], first: list[int]) -> list[int]:
        """``order`` with the next sentence (the one starting where it ends) ranked right after
        each of its first ``recall_next`` sentences: a head that attends a sentence while the
        model copies it reads on into the next one a few steps later (an induction head's next
        target), and a selection reused over decode steps (``recall_every``) must already hold it."""
        if not self.recall_next:
            return order
        out = []
        for rank, sid in enumerate(order):
            out.append(sid)
            nxt = sid + 1
            if rank < self.recall_next and nxt < len(lengths) and first[nxt] == first[sid] + lengths[sid]:
                out.append(nxt)
        return out

    def _fill_from_window(self, state: SequenceKV) -> None:
        stats = state.stats
        for layer in range(state.pool.num_layers):
            q = None if stats is None else stats.queries[layer]
            if q is not None:
                self.recall(state, layer, q)
