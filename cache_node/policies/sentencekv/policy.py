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
from cache_node.compaction import gather_kv
from cache_node.kv_pool import KVPool
from cache_node.policies.base import Policy, protected_mask
from cache_node.policies.quant import channel_group
from cache_node.policies.registry import register
from cache_node.policies.sentencekv.bound import KeyBounds, RecallBoundStats
from cache_node.policies.sentencekv.bound_step import step_bound
from cache_node.policies.sentencekv.host_kv import PrivateHostKV, TierHostKV
from cache_node.policies.sentencekv.layer_budget import layer_shares, split_slots
from cache_node.policies.sentencekv.overflow import ChainedKV, OverflowKV
from cache_node.policies.sentencekv.region import QuantSentenceRegion, SentenceCodes, SentenceRegion
from cache_node.policies.sentencekv.shortlist import head_scores, shortlist
from cache_node.policies.sentencekv.sketch import KeySketch, LayeredSketch
from cache_node.policies.sentencekv.store import HostSentenceStore
from cache_node.tiers.fair_lru import holder_of

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV


# The fields a preset sets when the spec leaves them out (``SentenceKV.preset``). "standard":
# int8 region codes per 16 channels, a 2-bit sketch of every channel, recall every decode step.
# "compact", for an eighth of the device bytes: one int8 scale per token and K/V (groups of
# 64 channels) on keys centred and scaled per channel (KIVI §3), so the bytes go to slots;
# the sketch of the keys' top-32 principal directions (Loki), each divided by its spread, in
# groups of 32; the region's slots split among the layers by where the window queries'
# attention lies (``layer_budget.py``); the last query fills 3/4 of the region; the second half
# of the layers (the deep layers) score on 4-bit codes and reselect every decode step, the
# first half every eighth (Quest/ShadowKV reuse); no headroom block, so the region gets it.
# Those three took the 1k KL over seeds 0-2 from 0.094 to 0.050 and the 2k KL over seeds 0-1
# from 0.057 to 0.047, at TPOT 1.18-1.23x the full cache's, median 1.20x over ten runs
# (bench/README.md "Deep layers", "The headroom block and the layer knobs", "The compact
# preset, ninth session", "One attention call per decode step").
# Measured on SmolLM2-135M (bench/README.md "8x", "The compact preset", "Layer split"): at
# 12.5% compact answered every pass key at 1k-8k where standard lost them at 4k; the layer
# split and whitening took the 4k KL over six contexts from 0.089 to 0.037 (but raised two 1k
# contexts' from 0.043 to 0.102); TPOT ~1.2-1.3x the full cache's against ~1.5x; at 25%
# standard had the lower KL, hence a budget-dependent default.
PRESETS: dict[str, dict[str, int | float | str]] = {
    "standard": {"last_query_share": 0.5, "sketch_group": 16, "sketch_rank": 0, "region_group": 16,
                 "region_key_scale": 0, "recall_every": 1, "sketch_whiten": 0,
                 "layer_budget": "uniform", "recall_next": 0, "deep_from": 1.0, "deep_sketch_bits": 2,
                 "deep_recall_every": 1, "deep_sketch_whiten": 0, "layer_floor": 0.5, "headroom_blocks": 1},
    "compact": {"last_query_share": 0.75, "sketch_group": 32, "sketch_rank": 32, "region_group": 64,
                "region_key_scale": 1, "recall_every": 8, "sketch_whiten": 1,
                "layer_budget": "mass", "recall_next": 0, "deep_from": 0.5, "deep_sketch_bits": 4,
                "deep_recall_every": 1, "deep_sketch_whiten": 1, "layer_floor": 0.5, "headroom_blocks": 0},
}
COMPACT_BUDGET = 0.125  # "auto" picks "compact" at budgets of at most this fraction of the prompt


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
    ``sketch_bits``/``sketch_group`` size the key sketch (``select_mode="sketch"``), and
    ``sketch_rank`` > 0 sketches each key's coordinates in its top principal directions
    instead of every channel (``KeySketch``, Loki);
    ``region_bits``/``region_group`` the recall region's codes (0: the pool's dtype);
    ``region_key_scale`` 1 centres and scales keys per channel before coding them (KIVI §3;
    ``SentenceCodes``).
    ``recall_every`` k > 1: a decode step re-selects a layer's region only when the sequence's
    computed-token count is a multiple of k (prefill chunks always do); between, the region
    keeps the sentences the last selection chose, as Quest and ShadowKV reuse a page selection
    over nearby decode queries. It divides the sketch scoring, selection and loads by ~k.

    ``sketch_whiten`` 1 (with ``sketch_rank``) divides each principal coordinate by its spread
    over the fitted keys before the codes, so a 2-bit group of 32 coordinates codes every one of
    them and not just the largest few (the query is scaled back; KIVI §3's per-channel scaling
    applied to Loki's coordinates).
    ``layer_budget`` "mass" splits the region's slots among the layers, once per sequence at
    its first compression, by where the window queries' attention over the demoted tokens
    lies (``layer_budget.layer_shares``: PyramidKV/SpindleKV layer budgets, with G-KV's global
    ranking across layers), each layer keeping at least ``layer_floor`` of an equal share;
    "uniform" gives every layer R slots (as ``layer_floor`` 1 does).
    ``recall_next`` k > 0 ranks, after each of a head's k best sentences, the sentence that
    follows it, so a reused selection holds the text the model is about to copy.
    ``deep_from`` f < 1: the layers from ``round(f * L)`` on (the deep layers) score with
    ``deep_sketch_bits`` codes (``LayeredSketch``) and reselect every ``deep_recall_every``
    decode steps. On SmolLM2-135M at 12.5% of the bytes, ranking sentences by their exact
    softmax mass at every step only in the second half of the layers took the 1k KL from 0.102
    to 0.044 (in the first half it changed nothing), while a 2-bit sketch reselecting every
    step there did not help (0.099) and a 4-bit one did (0.063): the deep layers' queries pick
    sharply among sentences and move from token to token (bench/README.md "Deep layers").
    "compact" turns the deep layers on (``deep_from`` 0.5) and lets the first half reselect
    only every eighth step (``recall_every`` 8), which wins back part of their cost (TPOT
    1.18-1.23x the full cache's, median 1.20x; 1.11-1.26x without them in earlier runs); "standard" leaves them off
    (``deep_from`` 1). ``deep_sketch_whiten`` is
    ``sketch_whiten`` for the deep layers' codes.
    ``headroom_blocks``: pool blocks beyond the sinks' and window's that decoding fills before
    the next compaction (charged to the budget, so taken from the region). 0 leaves only the
    free slots of the window's last block, so a compaction comes every few tokens (with
    sinks 4 and window 16 in 16-token blocks, every 12), but the region gets that block: on a
    1k context at 12.5% that is 16 of the 128 budget tokens ("compact" takes 0, "standard" 1;
    0 alone, without the deep layers, lost pass keys at 2k). A compaction during decoding
    keeps the regions' selections and only resizes them (``HostSentenceStore.fit_region``).

    ``preset`` ("auto", "standard" or "compact"; ``PRESETS``) gives the fields above that a
    spec leaves out: "auto" (the default) takes "compact" for fractional budgets of at most
    ``COMPACT_BUDGET`` (1/8) and "standard" otherwise (token budgets included), since each was
    the better one at its budget on the quality harness (bench/README.md "8x"). So
    ``sentencekv-0.125`` is ``sentencekv-0.125-preset_compact`` and
    ``sentencekv-0.125-preset_standard-recall_every_2`` the standard fields but one.

    Recall bound (``bound.py``): every demoted sentence keeps per-channel key bounds per layer
    and KV head (Quest §3), and each decode step records, per layer and query head, an upper
    bound on the softmax mass of the tokens it does not attend; the request's max and mean over
    steps go to its finished output (``Sequence.policy_stats``). ``bound_tier``: where the
    bounds live and are charged: ``"host"`` (host RAM, charged to the host tier, the bound
    computed there from the query), ``"device"`` (counted in the index's device bytes, so the
    region shrinks), ``"off"`` (no bound), or ``"auto"`` (the default: ``"host"`` in
    exact-recall mode, else ``"off"``: the bound adds ~20% to a decode step on this CPU, so a
    request pays for it only when it asks, with ``recall_eps`` or ``bound_tier_host``). At a
    25% budget on SmolLM2-135M with 1k-token contexts, device bounds take ~20
    token-equivalents from the region (bench/README.md).

    Exact-recall mode (``recall_eps`` > 0, e.g. ``sentencekv-0.25-recall_eps_0.01``): after the
    budgeted recall, each layer recalls further sentences, in decreasing ``n_s exp(ub_s)``, into
    an overflow region of raw K/V sized as needed, until the bound is below ``recall_eps``
    for every query head (dropped sentences cannot be recalled: the bound may stay above).
    The device bytes then exceed the budget on the steps that need it, by one layer's overflow
    at a time (the overflow is rebuilt per layer and step and not charged to the pool);
    ``device_bytes_peak`` in the stats reports the peak.

    Raises:
        ValueError: an unknown ``select_mode``, ``sketch_bits``, ``region_bits``,
            ``layer_budget``, ``bound_tier`` or ``preset``, ``recall_every`` or ``deep_recall_every``
            below 1, ``recall_next`` below 0, ``deep_from`` outside [0, 1], ``deep_sketch_bits`` not
            1/2/4/8, ``sketch_whiten`` or ``deep_sketch_whiten`` not 0/1 (or 1 without ``sketch_rank``),
            ``layer_floor`` outside [0, 1], ``region_key_scale`` not 0/1 (or 1
            without region codes), ``recall_eps`` outside [0, 1) or set with ``bound_tier="off"``, or
            ``cold_bits`` set (sentencekv demotes to host RAM).
    """

    name = "sentencekv"
    needs = StatsNeeds(window_queries=16)
    window_tokens: int = 16
    max_sentence_tokens: int = 48
    select_mode: str = "sketch"
    last_query_share: float = None  # type: ignore[assignment]  # None: from ``preset``
    sketch_bits: int = 2
    sketch_group: int = None  # type: ignore[assignment]
    sketch_rank: int = None  # type: ignore[assignment]
    sketch_whiten: int = None  # type: ignore[assignment]
    region_bits: int = 8
    region_group: int = None  # type: ignore[assignment]
    region_key_scale: int = None  # type: ignore[assignment]
    recall_every: int = None  # type: ignore[assignment]
    layer_budget: str = None  # type: ignore[assignment]
    recall_next: int = None  # type: ignore[assignment]
    deep_from: float = None  # type: ignore[assignment]
    deep_sketch_bits: int = None  # type: ignore[assignment]
    deep_recall_every: int = None  # type: ignore[assignment]
    deep_sketch_whiten: int = None  # type: ignore[assignment]
    layer_floor: float = None  # type: ignore[assignment]
    headroom_blocks: int = None  # type: ignore[assignment]
    bound_tier: str = "auto"
    recall_eps: float = 0.0
    preset: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preset not in ("auto", *PRESETS):
            raise ValueError(f"unknown preset {self.preset!r}; known: auto, {', '.join(PRESETS)}")
        for key, value in PRESETS[self.resolved_preset].items():
            if getattr(self, key) is None:  # a field the spec names wins over the preset
                setattr(self, key, value)
        if self.select_mode not in ("sketch", "cos", "mass", "mean"):
            raise ValueError(f"unknown select_mode {self.select_mode!r}; known: sketch, cos, mass, mean")
        if self.cold_bits:
            raise ValueError("sentencekv demotes to host RAM; cold_bits does not apply")
        for key in ("max_sentence_tokens", "sketch_group", "region_group"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.last_query_share <= 1:
            raise ValueError(f"last_query_share must be in [0, 1], got {self.last_query_share}")
        if self.sketch_bits not in (1, 2, 4, 8):
            raise ValueError(f"sketch_bits must be 1, 2, 4 or 8, got {self.sketch_bits}")
        if (not isinstance(self.sketch_rank, int) or self.sketch_rank < 0 or self.sketch_rank % 8
                or self.sketch_rank % min(self.sketch_group, self.sketch_rank or 1)):
            raise ValueError(f"sketch_rank must be 0 (every channel) or a multiple of 8 and of sketch_group "
                             f"(or below it), got {self.sketch_rank!r}")
        if self.sketch_whiten not in (0, 1) or (self.sketch_whiten and not self.sketch_rank):
            raise ValueError(f"sketch_whiten must be 0 or 1, and 1 needs sketch_rank > 0, got {self.sketch_whiten!r}")
        if self.region_bits not in (0, 4, 8):
            raise ValueError(f"region_bits must be 0 (the pool's dtype), 4 or 8, got {self.region_bits}")
        if not isinstance(self.recall_every, int) or self.recall_every < 1:
            raise ValueError(f"recall_every must be an integer >= 1, got {self.recall_every!r}")
        if self.region_key_scale not in (0, 1) or (self.region_key_scale and not self.region_bits):
            raise ValueError(f"region_key_scale must be 0 or 1, and 1 needs region_bits 4 or 8, "
                             f"got {self.region_key_scale!r}")
        if not isinstance(self.recall_next, int) or self.recall_next < 0:
            raise ValueError(f"recall_next must be an integer >= 0, got {self.recall_next!r}")
        if not isinstance(self.deep_from, (int, float)) or not 0 <= self.deep_from <= 1:
            raise ValueError(f"deep_from must be a fraction of the layers in [0, 1], got {self.deep_from!r}")
        if self.deep_sketch_bits not in (1, 2, 4, 8):
            raise ValueError(f"deep_sketch_bits must be 1, 2, 4 or 8, got {self.deep_sketch_bits!r}")
        if not isinstance(self.deep_recall_every, int) or self.deep_recall_every < 1:
            raise ValueError(f"deep_recall_every must be an integer >= 1, got {self.deep_recall_every!r}")
        if self.deep_sketch_whiten not in (0, 1) or (self.deep_sketch_whiten and not self.sketch_rank):
            raise ValueError(f"deep_sketch_whiten must be 0 or 1, and 1 needs sketch_rank > 0, "
                             f"got {self.deep_sketch_whiten!r}")
        if not isinstance(self.layer_floor, (int, float)) or not 0 <= self.layer_floor <= 1:
            raise ValueError(f"layer_floor must be a fraction of an equal share in [0, 1], got {self.layer_floor!r}")
        if not isinstance(self.headroom_blocks, int) or self.headroom_blocks < 0:
            raise ValueError(f"headroom_blocks must be an integer >= 0, got {self.headroom_blocks!r}")
        if self.layer_budget not in ("uniform", "mass"):
            raise ValueError(f"unknown layer_budget {self.layer_budget!r}; known: uniform, mass")
        if self.bound_tier not in ("auto", "host", "device", "off"):
            raise ValueError(f"unknown bound_tier {self.bound_tier!r}; known: auto, host, device, off")
        if not isinstance(self.recall_eps, (int, float)) or not 0 <= self.recall_eps < 1:
            raise ValueError(f"recall_eps must be a number in [0, 1), got {self.recall_eps!r}")
        if self.recall_eps and self.bound_tier == "off":
            raise ValueError("recall_eps needs the key bounds: bound_tier must be host or device")

    @property
    def resolved_preset(self) -> str:
        """``preset`` with ``"auto"`` resolved: ``"compact"`` for budgets of at most
        ``COMPACT_BUDGET`` of the prompt (a fraction), else ``"standard"``."""
        if self.preset != "auto":
            return self.preset
        return "compact" if self.budget <= COMPACT_BUDGET else "standard"

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
            sketch = self._sketch(state.pool.num_layers) if self.select_mode == "sketch" else None
            host = PrivateHostKV() if state.host is None else TierHostKV(state.host, holder_of(state.seq.cache_namespace))
            store = state.extra["sentences"] = HostSentenceStore(host, sketch)
            if self.region_bits:
                store.codes = SentenceCodes(self.region_bits, self._region_group(state), bool(self.region_key_scale))
            if self._bounds_at != "off":
                device = state.pool.kv.device if self._bounds_at == "device" else "cpu"
                state.extra["key_bounds"] = KeyBounds(device)
                state.extra["recall_bound"] = RecallBoundStats()
        return store

    def deep_start(self, num_layers: int) -> int:
        """The first of the deep layers (``deep_from`` of ``num_layers``, rounded)."""
        return min(num_layers, round(self.deep_from * num_layers))

    def _sketch(self, num_layers: int) -> KeySketch | LayeredSketch:
        """The key sketch: ``sketch_bits`` codes, and ``deep_sketch_bits`` in the deep layers."""
        def make(bits: int, whiten: int) -> KeySketch:
            return KeySketch(bits, self.sketch_group, self.sketch_rank, bool(whiten))
        deep = self.deep_start(num_layers)
        shallow, deep_part = (self.sketch_bits, self.sketch_whiten), (self.deep_sketch_bits, self.deep_sketch_whiten)
        if deep >= num_layers or deep_part == shallow:
            return make(*shallow)
        if deep == 0:
            return make(*deep_part)
        return LayeredSketch([(0, make(*shallow)), (deep, make(*deep_part))])

    def _demote(self, state: SequenceKV, store: HostSentenceStore, kv: torch.Tensor, positions: torch.Tensor) -> None:
        """Demote one sentence ``kv`` (L, n, 2, H_kv, d) at ``positions`` and record its key
        bounds (a dropped sentence's too: it stays missed). Host-tier bounds are charged to the
        host tier; what it cannot hold is counted in ``private_host_bytes`` instead."""
        stored = store.put(kv, positions)
        if not stored:  # lost, as on eviction: the request's finished event and the node say so
            state.seq.policy_stats["dropped_tokens"] = float(store.dropped_tokens)
        bounds: KeyBounds | None = state.extra.get("key_bounds")
        if bounds is None:
            return
        before = bounds.nbytes
        bounds.append(kv[:, :, 0], len(store) - 1 if stored else -1, self.region_bits, self._region_group(state),
                      None if store.codes is None else store.codes.key_affine)
        grown = bounds.nbytes - before
        if self._bounds_at == "host" and isinstance(store.host, TierHostKV) and store.host.add(kv[:, :0], grown) is None:
            state.extra["bounds_uncharged"] = state.extra.get("bounds_uncharged", 0) + grown

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
        runs = self.segments(state, pos0[demote])
        if isinstance(store.host, TierHostKV) and state.wait_for_host(self._host_slots(state, store, runs),
                                                                      store.host.holder):
            return False  # other tenants' running requests hold the host tier over their share
        if not state.can_rewrite(len(keep)):
            return False
        fit_sketch = store.sketch is not None and store.sketch.rank and store.sketch.basis is None
        fit_scale = store.codes is not None and store.codes.use_key_scale and store.codes.key_scale is None
        fit_split = self.layer_budget == "mass" and store.layer_share is None and state.stats is not None
        keys = None
        if fit_sketch or fit_scale or fit_split:
            keys = gather_kv(state.pool, state.seq, demote.unsqueeze(0).expand(L, -1))[:, :, 0]
            if fit_sketch:
                store.sketch.fit(keys)
            if fit_scale:
                store.codes.fit_key_scale(keys)
        for run in runs:
            slots = demote[run]
            self._demote(state, store, gather_kv(state.pool, state.seq, slots.unsqueeze(0).expand(L, -1)), pos0[slots])
        kept = gather_kv(state.pool, state.seq, keep.unsqueeze(0).expand(L, -1))
        demoted_pos, kept_pos = pos0[demote], pos0[keep]  # advanced indexing: copies
        positions = kept_pos.expand(L, -1).clone()
        state.set_layout(kept, positions, torch.ones(positions.shape, device=positions.device), dense=True)
        r = self.region_tokens(state, store)
        if fit_split and keys is not None and r:
            assert state.stats is not None
            store.layer_share = layer_shares(state.stats.queries, state.stats.query_pos, keys, demoted_pos,
                                             kept[:, :, 0], kept_pos, state.scaling, r, self.layer_floor)
        sizes = [r] * L if store.layer_share is None else split_slots(r * L, store.layer_share)
        first = store.region_positions is None
        if first:
            store.resize_region(sizes, state.pool.kv, self.region_bits, self._region_group(state))
        else:  # keep the selections; the next one (a prefill chunk, or a decode step's) fills the slots
            store.fit_region(sizes)
        if state.stats is not None:
            state.stats.compact([keep] * L)
        if first:
            self._fill_from_window(state)
        return True

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

    def _fill_from_window(self, state: SequenceKV) -> None:
        stats = state.stats
        for layer in range(state.pool.num_layers):
            q = None if stats is None else stats.queries[layer]
            if q is not None:
                self.recall(state, layer, q)

    # ---- promotion at decode ----------------------------------------------------------------
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

    def _reuse_selection(self, state: SequenceKV, store: HostSentenceStore, layer_idx: int, q: torch.Tensor) -> bool:
        """Whether this decode step keeps the layer's last selection (``recall_every``, or
        ``deep_recall_every`` in the deep layers)."""
        every = self.deep_recall_every if layer_idx >= self.deep_start(state.pool.num_layers) else self.recall_every
        return (every > 1 and q.shape[0] == 1 and layer_idx in store.resident
                and state.seq.num_computed_tokens % every != 0)

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

    def host_slots(self, state: SequenceKV) -> int:
        store = state.extra.get("sentences")
        return 0 if store is None else store.host.num_held_slots

    def release(self, state: SequenceKV) -> None:
        store = state.extra.get("sentences")
        if store is not None:
            store.host.release()

    # ---- accounting -------------------------------------------------------------------------
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
