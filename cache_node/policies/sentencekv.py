"""SentenceKV: sentence-level semantic KV caching with recall from the host tier.

Device layout per layer (physical slot order = position order)::

    | sinks | recall region (R slots: the top sentences for this layer) | window | new ... |

Every token outside sinks and the recent window is grouped into sentences; a sentence's raw
K/V goes to the host tier and its mean key per layer and KV head stays on the device tier.
Before each layer attends, the queries of the step score every sentence by
``cos(q, mean_key)`` per KV head (best over the step's queries and the head's query group) and
the sentences that fit R are promoted into the region, each head taking its next best in turn;
in a multi-token chunk the last query (the one sampled from) picks first, up to
``last_query_share`` of R. KV is copied in only when the selection changes; decoding one token
per step, recall follows every decode step. Budget = sinks + R + window + one block of
headroom + mean-key bytes (in tokens).

Source: Zhu et al., "SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV
Caching" (arXiv 2504.00970), §3.2 (sentence-level compression at prefill: semantic vectors on
GPU, token KV offloaded to CPU) and §3.3 (decode: select sentences by query/semantic-vector
similarity and load their KV). FAISS inner-product search when the candidate set is large.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cache_node.attention_stats import StatsNeeds
from cache_node.compaction import can_rewrite, gather_kv
from cache_node.policies.base import Policy
from cache_node.policies.registry import register

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV

FAISS_MIN_SENTENCES = 2048


@dataclass
class HostSentenceStore:
    """Sentences demoted to host RAM (the policy's own store; small interface: ``put``/``kv``).

    ``mean_keys``: (S, L, H_kv * d) each sentence's mean key per layer and KV head (scored
    per head by ``head_scores``); it is the only per-sentence data on the device tier.
    """

    positions: list[torch.Tensor] = field(default_factory=list)
    host_kv: list[torch.Tensor] = field(default_factory=list)  # (L, n, 2, H_kv, d) CPU
    mean_keys: torch.Tensor | None = None
    resident: dict[int, tuple[int, ...]] = field(default_factory=dict)  # layer -> sentence ids
    recall_s: float = 0.0
    num_recalls: int = 0

    def put(self, kv: torch.Tensor, positions: torch.Tensor, mean_key: torch.Tensor) -> None:
        self.host_kv.append(kv.to("cpu", copy=True))
        self.positions.append(positions.clone())
        mk = mean_key.unsqueeze(0)
        self.mean_keys = mk if self.mean_keys is None else torch.cat([self.mean_keys, mk])

    def __len__(self) -> int:
        return len(self.host_kv)

    def fork(self) -> HostSentenceStore:
        """A copy sharing the immutable host tensors."""
        return HostSentenceStore(list(self.positions), list(self.host_kv), self.mean_keys,
                                 dict(self.resident), self.recall_s, self.num_recalls)


def shortlist(mean_keys: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor | None:
    """FAISS inner-product shortlist when the candidate set is large, else None (score all).

    ``mean_keys``: (S, H_kv, d); ``q``: (n, H, d). Returns the sorted union, over KV heads, of
    each head's ``k`` best sentences for the chunk's mean unit query.
    """
    s, h_kv = mean_keys.shape[:2]
    if s < FAISS_MIN_SENTENCES:
        return None
    try:
        import faiss
    except ImportError:
        return None
    mk = F.normalize(mean_keys.float(), dim=-1)
    qn = F.normalize(F.normalize(q.float().view(q.shape[0], h_kv, -1, q.shape[-1]), dim=-1).mean((0, 2)), dim=-1)
    found = []
    for h in range(h_kv):
        index = faiss.IndexFlatIP(mk.shape[-1])
        index.add(mk[:, h].contiguous().numpy())
        _, ids = index.search(qn[h : h + 1].contiguous().numpy(), min(k, s))
        found.append(torch.from_numpy(ids[0]).long())
    return torch.cat(found).unique()


def head_scores(mean_keys: torch.Tensor, q: torch.Tensor, mode: str, scaling: float,
                lengths: torch.Tensor) -> torch.Tensor:
    """(H_kv, S) how much each sentence matters to the step's queries, per KV head.

    ``mean_keys``: (S, H_kv, d) mean keys of one layer; ``q``: (n, H, d); ``lengths``: (S,).
    Every mode takes the best over the step's queries and the head group's query heads (a
    decode step has one query: the paper's per-step score).
    ``"cos"``: cos(q, mean_key) (SentenceKV §3.3). ``"mass"``: ``scaling * q . mean_key +
    log(len)``, a lower bound (Jensen) on the log of the softmax mass the sentence's tokens
    would receive. ``"mean"``: cos with the chunk's mean unit query (one direction per chunk).
    """
    h_kv = mean_keys.shape[1]
    qg = q.float().view(q.shape[0], h_kv, -1, q.shape[-1])  # (n, H_kv, g, d)
    mk = mean_keys.float()
    if mode == "mass":
        sims = torch.einsum("nhgd,shd->nhgs", qg, mk) * scaling + lengths.float().log()
        return sims.amax(dim=(0, 2))
    qn, mk = F.normalize(qg, dim=-1), F.normalize(mk, dim=-1)
    if mode == "mean":
        return torch.einsum("hd,shd->hs", F.normalize(qn.mean((0, 2)), dim=-1), mk)
    if mode != "cos":
        raise ValueError(f"unknown select_mode {mode!r}; known: cos, mass, mean")
    return torch.einsum("nhgd,shd->nhgs", qn, mk).amax(dim=(0, 2))


@register
@dataclass
class SentenceKV(Policy):
    """See the module docstring. ``max_sentence_tokens`` splits run-on sentences."""

    name = "sentencekv"
    needs = StatsNeeds(window_queries=16)
    window_tokens: int = 16
    max_sentence_tokens: int = 48
    select_mode: str = "cos"
    last_query_share: float = 0.5

    # ---- segmentation and demotion ---------------------------------------------------------
    def segments(self, state: SequenceKV, positions: torch.Tensor) -> list[torch.Tensor]:
        """Split ascending ``positions`` into sentences (index runs into ``positions``)."""
        tokens = state.seq.all_token_ids
        ends = state.env.sentence_end_token_ids
        out, start = [], 0
        for i, p in enumerate(positions.tolist()):
            if tokens[p] in ends or i + 1 - start >= self.max_sentence_tokens or i + 1 == len(positions):
                out.append(torch.arange(start, i + 1))
                start = i + 1
        return out

    def _store(self, state: SequenceKV) -> HostSentenceStore:
        return state.extra.setdefault("sentences", HostSentenceStore())

    def region_tokens(self, state: SequenceKV, num_sentences: int) -> int:
        """R: the budget left after sinks, window, the mean keys (in token-equivalents) and one
        block of decode headroom, so peak device bytes stay within the budget."""
        assert state.budget is not None
        mean_key_tokens = math.ceil(num_sentences / 2)  # a mean key is half a token's KV
        bs = state.pool.block_size
        slots = (state.budget - mean_key_tokens) // bs * bs  # whole blocks: bytes, not tokens
        # one block of headroom: decoding fills it before the next demotion, within budget
        return max(0, slots - bs - self.sink_tokens - self.window_tokens)

    def compress(self, state: SequenceKV) -> bool:
        assert state.budget is not None
        store = self._store(state)
        if state.frontier + math.ceil(len(store) / 2) <= state.budget + self.evict_every:
            return False  # pool slots plus mean keys (half a token each) still fit the budget
        region_end = state.extra.get("region_end", self.sink_tokens)
        pos0 = state.positions[0]
        fresh = torch.arange(region_end, state.frontier)  # window + new, identical in all layers
        demote, window = fresh[: -self.window_tokens or None], fresh[len(fresh) - self.window_tokens :]
        L = state.pool.num_layers
        runs = self.segments(state, pos0[demote]) if len(demote) else []
        sinks = torch.arange(min(self.sink_tokens, region_end))
        r = self.region_tokens(state, len(store) + len(runs))
        m = len(sinks) + r + len(window)
        if not can_rewrite(state.block_pool, state.seq, m, state.pool.block_size):
            return False
        for run in runs:
            slots = demote[run]
            kv = gather_kv(state.pool, state.seq, slots.unsqueeze(0).expand(L, -1))
            store.put(kv, pos0[slots], kv[:, :, 0].float().mean(1).flatten(-2))
        keep = torch.cat([sinks, window])
        kept = gather_kv(state.pool, state.seq, keep.unsqueeze(0).expand(L, -1))
        data = torch.zeros((L, m, *kept.shape[2:]), dtype=kept.dtype)
        positions = torch.full((L, m), -1, dtype=torch.long)
        data[:, : len(sinks)], data[:, m - len(window) :] = kept[:, : len(sinks)], kept[:, len(sinks) :]
        positions[:, : len(sinks)] = pos0[sinks]
        positions[:, m - len(window) :] = pos0[window]
        state.set_layout(data, positions, (positions >= 0).float())
        state.extra["region"] = (len(sinks), r)
        state.extra["region_end"] = len(sinks) + r
        store.resident.clear()
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
        if "region" in state.extra:
            self.recall(state, layer_idx, q)

    def recall(self, state: SequenceKV, layer_idx: int, q: torch.Tensor) -> None:
        """Promote the sentences ``q`` (n, H, d) points at into the layer's recall region."""
        store = self._store(state)
        start, r = state.extra["region"]
        if r == 0 or not len(store):
            return
        assert store.mean_keys is not None
        h_kv = state.pool.num_kv_heads
        mk = store.mean_keys[:, layer_idx].view(len(store), h_kv, -1)  # (S, H_kv, d)
        lengths = torch.tensor([len(p) for p in store.positions])
        cand = shortlist(mk, q, r)
        if cand is not None:
            mk, lengths = mk[cand], lengths[cand]
        scores = [head_scores(mk, q, self.select_mode, state.scaling, lengths)]
        if q.shape[0] > 1 and self.last_query_share > 0:  # the chunk's last query is sampled from
            scores.insert(0, head_scores(mk, q[-1:], self.select_mode, state.scaling, lengths))
        chosen_t = self.select(store, scores, r, cand)
        if store.resident.get(layer_idx) == chosen_t:
            return
        t0 = time.perf_counter()
        self._load(state, layer_idx, chosen_t, start, r)
        store.resident[layer_idx] = chosen_t
        store.recall_s += time.perf_counter() - t0
        store.num_recalls += 1

    def select(self, store: HostSentenceStore, scores: list[torch.Tensor], r: int,
               cand: torch.Tensor | None = None) -> tuple[int, ...]:
        """Sentences that fit ``r`` slots, in position order. Each KV head takes its next best
        in turn (so every head gets what it points at). With two score sets (the chunk's last
        query, then all its queries), the first may fill ``last_query_share`` of ``r``.
        ``scores``: list of (H_kv, S) over all sentences, or over the shortlist ``cand``."""
        lengths = [len(p) for p in store.positions]
        chosen: dict[int, None] = {}
        used = 0
        caps = [int(self.last_query_share * r), r] if len(scores) == 2 else [r]
        for sc, cap in zip(scores, caps):
            ranked = sc.argsort(dim=1, descending=True).T.reshape(-1)  # rank-major
            for sid in (ranked if cand is None else cand[ranked]).tolist():
                if sid not in chosen and used + lengths[sid] <= cap:
                    chosen[sid] = None
                    used += lengths[sid]
        return tuple(sorted(chosen, key=lambda s: int(store.positions[s][0])))

    def _load(self, state: SequenceKV, layer: int, sids: tuple[int, ...], start: int, r: int) -> None:
        store = self._store(state)
        pos = torch.full((r,), -1, dtype=torch.long)
        if sids:
            kv = torch.cat([store.host_kv[s][layer] for s in sids])  # (n, 2, H, d)
            p = torch.cat([store.positions[s] for s in sids])
            bs = state.pool.block_size
            ids = torch.tensor([b.block_id for b in state.seq.block_table], dtype=torch.long)
            slots = torch.arange(start, start + len(p))
            pool_slots = ids[slots // bs] * bs + slots % bs
            state.pool.kv[layer, :, pool_slots] = kv.transpose(0, 1).to(state.pool.kv)
            pos[: len(p)] = p
        state.positions[layer, start : start + r] = pos
        state.support[layer, start : start + r] = (pos >= 0).float()

    # ---- accounting -------------------------------------------------------------------------
    def extra_device_bytes(self, state: SequenceKV) -> int:
        store = state.extra.get("sentences")
        if store is None or store.mean_keys is None:
            return 0
        return store.mean_keys.shape[0] * state.pool.num_layers * state.pool.num_kv_heads * (
            state.pool.head_dim * state.pool.kv.element_size()
        )
