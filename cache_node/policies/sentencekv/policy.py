"""The SentenceKV policy (registered as ``sentencekv``): demote all but sinks and window to host
RAM sentence by sentence, and before each layer attends recall per KV head the sentences the
query points at. The design, budget and sources are in the package docstring.

``SentenceKV`` holds the fields, their checks, segmentation and demotion (``compress``); its
recall at attention time is ``recall.SentenceRecall``, its accounting ``budget.SentenceBudget``,
and its presets ``presets.PRESETS``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cache_node.attention_stats import StatsNeeds
from cache_node.compaction import gather_kv
from cache_node.policies.base import Policy, protected_mask
from cache_node.policies.registry import register
from cache_node.policies.sentencekv.bound import KeyBounds, RecallBoundStats
from cache_node.policies.sentencekv.budget import SentenceBudget
from cache_node.policies.sentencekv.host_kv import PrivateHostKV, TierHostKV
from cache_node.policies.sentencekv.layer_budget import layer_shares, split_slots
from cache_node.policies.sentencekv.presets import COMPACT_BUDGET, PRESETS
from cache_node.policies.sentencekv.recall import SentenceRecall
from cache_node.policies.sentencekv.region import SentenceCodes
from cache_node.policies.sentencekv.sketch import KeySketch, LayeredSketch
from cache_node.policies.sentencekv.store import HostSentenceStore
from cache_node.tiers.fair_lru import holder_of

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV


@register
@dataclass
class SentenceKV(SentenceRecall, SentenceBudget, Policy):
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
    computed-token count is a multiple of k (a prompt's spans always do:
    ``SentenceRecall.prompt_span``); between, the region
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
            # (its own drops: those of the state it forked are ``inherited_dropped_tokens``)
            state.seq.policy_stats["dropped_tokens"] = float(store.dropped_tokens - state.inherited_lost_tokens)
        bounds: KeyBounds | None = state.extra.get("key_bounds")
        if bounds is None:
            return
        before = bounds.nbytes
        bounds.append(kv[:, :, 0], len(store) - 1 if stored else -1, self.region_bits, self._region_group(state),
                      None if store.codes is None else store.codes.key_affine)
        grown = bounds.nbytes - before
        if self._bounds_at == "host" and isinstance(store.host, TierHostKV) and store.host.add(kv[:, :0], grown) is None:
            state.extra["bounds_uncharged"] = state.extra.get("bounds_uncharged", 0) + grown

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

    def lost_tokens(self, state: SequenceKV) -> int:
        """The sentences' tokens demoted while the host tier was full (``dropped_tokens``;
        a fork's store starts from its parent's count)."""
        store = state.extra.get("sentences")
        return 0 if store is None else store.dropped_tokens

    def release(self, state: SequenceKV) -> None:
        store = state.extra.get("sentences")
        if store is not None:
            store.host.release()
