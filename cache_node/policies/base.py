"""The policy contract: one small class per policy, one scoring method, plumbing in the base.

A policy decides, per layer, which of a sequence's tokens keep their KV on the device tier.
The base class turns scores into a keep set (protecting sinks and the recent window); the
pool-side moving (compaction, copy-on-write) lives in ``cache_node.compaction``. Transforming
policies (merging, quantizing, host recall) override the ``plan``/hook methods instead.
Idea: NVIDIA kvpress presses (one method per press, plumbing once in a base class).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from cache_node.attention_stats import AttentionStats, StatsNeeds

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV


@dataclass
class LayerView:
    """What a policy sees of one layer of one sequence (read-only; do not modify).

    Attributes:
        keys, values: (n, H_kv, d) post-RoPE KV of the layer's valid slots, in slot order.
        positions: (n,) int64 absolute positions of those tokens.
        slots: (n,) int64 physical slot indices (into the sequence's block table) of those tokens.
        support: (n,) float32 how many original tokens each entry stands for (1 unless merged).
        stats: the sequence's attention statistics (None when the policy needs none).
        scaling: the attention softmax scale.
    """

    layer_idx: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    support: torch.Tensor
    stats: AttentionStats | None
    scaling: float

    def window_attention(self) -> torch.Tensor:
        """(H_kv, w, n) softmax attention of the last w recorded queries over these keys.

        Causal by position (a query never sees later tokens); averaged over each KV head's
        group of query heads. Raises RuntimeError when no queries were recorded.
        """
        if self.stats is None or self.stats.queries[self.layer_idx] is None:
            raise RuntimeError("window_attention needs StatsNeeds(window_queries>0)")
        q = self.stats.queries[self.layer_idx]
        q_pos = self.stats.query_pos[self.layer_idx]
        h_kv = self.keys.shape[1]
        qh = q.view(q.shape[0], h_kv, -1, q.shape[-1]).permute(1, 2, 0, 3)  # (H_kv, g, w, d)
        logits = qh @ self.keys.permute(1, 2, 0).unsqueeze(1) * self.scaling  # (H_kv, g, w, n)
        logits = logits + self.support.log().view(1, 1, 1, -1)
        causal = self.positions.view(1, -1) <= q_pos.view(-1, 1)  # (w, n)
        logits = logits.masked_fill(~causal, float("-inf"))
        return torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(1)

    def recent_attention(self) -> torch.Tensor:
        """(H_kv, n) max attention received over the last T units of the token stream (the
        prompt is one unit, each later token one: ``AttentionStats``, chunk-invariant)."""
        assert self.stats is not None
        return self.stats.recent_max(self.layer_idx, int(self.slots.max()) + 1)[:, self.slots]

    def cumulative_attention(self) -> torch.Tensor:
        """(H_kv, n) (decayed) cumulative attention received."""
        assert self.stats is not None
        return self.stats.cum[self.layer_idx][:, self.slots]


def top_k_stable(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of ``score`` (n,), ties going to the lower index, on every
    device. ``torch.topk`` breaks ties as its kernel happens to: max-pooled scores (SnapKV)
    are full of exact ties, and on the H200 (2026-12-04) CUDA kept other tokens than the CPU
    from the same scores, so the same request decoded differently on the two devices.
    O(n): one ``topk`` for the k-th value, then the ties below it in index order (a stable
    argsort was 4-9x slower than ``topk`` on the CPU at 131k tokens). Indices come in index
    order; a NaN score counts as -inf. No host sync on an accelerator: the kept indices are
    scattered to their ranks (exactly k are kept: a stable partition), not gathered by
    ``nonzero``, which waits for the device to know its output's size."""
    n = score.shape[0]
    if k >= n:
        return torch.arange(n, device=score.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=score.device)
    score = torch.nan_to_num(score, nan=float("-inf"))  # a NaN score is never kept first
    kth = torch.topk(score, k, sorted=False).values.min()  # the k-th largest value
    above = score > kth
    ties = score == kth  # of these, the lowest indices fill the remaining places
    keep = above | (ties & (ties.cumsum(0) <= k - above.sum()))
    if score.device.type == "cpu":  # no device to wait for; nonzero is ~2.5x faster here
        return keep.nonzero().flatten()
    return kept_in_order(keep, k)


def kept_in_order(keep: torch.Tensor, k: int) -> torch.Tensor:
    """``keep.nonzero().flatten()`` for a (n,) bool mask with exactly ``k`` set, without a host
    sync: a stable partition scatters kept entries to ranks 0..k-1 and the rest after them
    (each place written once), and the first k places are returned."""
    n = keep.shape[0]
    rank = torch.where(keep, keep.cumsum(0), k + (~keep).cumsum(0)) - 1
    out = torch.empty(n, dtype=torch.long, device=keep.device)
    return out.scatter_(0, rank, torch.arange(n, device=keep.device))[:k]


def protected_mask(positions: torch.Tensor, sink_tokens: int, window_tokens: int) -> torch.Tensor:
    """(n,) bool: which of ``positions`` (n,) (absolute, distinct, any order) are sinks (position
    < ``sink_tokens``) or among the ``window_tokens`` largest (the most recent). Zero means
    none of that kind: a window of 0 protects no recent token (never the whole sequence), a
    window of ``n`` or more protects all ``n``."""
    recent = torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
    if window_tokens > 0:
        recent[positions.argsort()[max(0, len(positions) - window_tokens) :]] = True
    return (positions < sink_tokens) | recent


@dataclass
class LayerPlan:
    """How one layer's slots are rewritten by a compaction.

    ``keep``: (m,) indices into the view's entries to keep, in their new order.
    ``merge_src``/``merge_dst``: optional (k,) view indices merged into kept entry number
    ``merge_dst`` (an index into ``keep``): K/V become support-weighted means.
    """

    keep: torch.Tensor
    merge_src: torch.Tensor | None = None
    merge_dst: torch.Tensor | None = None


class ExtraKV(Protocol):
    """KV a layer attends to outside the pool (e.g. quantized codes), joined into one softmax."""

    def logits(self, qh: torch.Tensor, scaling: float) -> torch.Tensor:
        """(H_kv, g, n, m) scaled scores for grouped queries ``qh`` (H_kv, g, n, d)."""
        ...

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        """(H_kv, g, n, d) weighted values for ``probs`` (H_kv, g, n, m)."""
        ...


class DenseExtraKV(ExtraKV, Protocol):
    """Extra KV that can also hand over its keys and values as plain tensors, so a decode query
    attends them and the pool's in one fused attention call (``SequenceKV.attend``)."""

    def dense_kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys and values (H_kv, m, d) in ``dtype`` (codes dequantized into a transient
        buffer of one layer), and (H_kv, m) bool ``True`` at the slots to skip (None: none)."""
        ...


@dataclass(frozen=True)
class PolicyEnv:
    """Tokenizer-derived facts a policy may need (set by whoever owns the tokenizer).

    ``sentence_end_token_ids``: tokens whose text ends a sentence (SentenceKV segmentation).
    """

    sentence_end_token_ids: frozenset[int] = frozenset()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> PolicyEnv:
        """The facts of ``tokenizer`` (a transformers tokenizer): each vocabulary id's text as
        ``tokenizer.decode([id])`` gives it, a sentence end when it ends in ``. ! ? \\n`` or
        ``."``. A fast tokenizer without ``clean_up_tokenization_spaces`` (the only step its
        ``decode`` adds to the Rust decoder's) is decoded in one Rust ``decode_batch`` call:
        the same texts, 0.37 s against 0.83-1.7 s one id at a time for SmolLM2's 49,152 ids
        (paid at every cache node start)."""
        ids = [[tid] for tid in range(len(tokenizer))]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            texts = backend.decode_batch(ids, skip_special_tokens=False)
        else:
            texts = [tokenizer.decode(one) for one in ids]
        ends = set()
        for tid, full in enumerate(texts):
            text = full.rstrip(" ")
            if text and (text[-1] in ".!?\n" or text.endswith(".\"")):
                ends.add(tid)
        return cls(frozenset(ends))


@dataclass
class Policy:
    """Base of every policy.

    Which keys a query attends (every scoring policy: streaming, h2o, snapkv, gkv, spindlekv):
    while the prompt is prefilled, every earlier token (the full cache). Once the whole prompt
    is computed, each layer keeps ``B = budget_tokens(num_prompt_tokens)`` entries: the sinks
    (positions ``0 .. sink_tokens - 1``), the ``window_tokens`` most recent positions, and the
    highest-scored of the rest up to ``B``; each new token adds one entry, and when a layer
    holds more than ``B + evict_every`` it is compacted back to ``B`` (``evict_every`` 0:
    after every step it is over ``B``). A query at position ``p`` attends the entries of its
    layer at positions ``<= p`` (itself included), plus, with ``cold_bits``, the evicted
    entries' int codes. A layer never holding more than ``B`` keeps everything.

    Args:
        budget: device-tier KV per layer, as a fraction (0, 1] of the prompt's tokens (fixed
            when the prompt is first compressed) or, when > 1, a number of tokens.
        sink_tokens: first tokens always kept (attention sinks, StreamingLLM §3); 0: none.
        window_tokens: most recent tokens always kept; 0: none (recency earns no protection).
        evict_every: tokens a layer may grow past its budget before the next compaction
            (0 = compact every step it is over budget).
        cold_bits: 0 drops what the policy evicts; 4 or 8 keeps it on the device tier as int4/
            int8 codes attended on the codes (HACK, arXiv 2502.03589 §4): the quantized tier as
            a colder tier under a scoring policy. The budget counts the full-precision entries;
            the codes' bytes are reported on top (``extra_device_bytes``) and charged to the
            pool as whole blocks (``SequenceKV.charge_blocks``).
    """

    name: ClassVar[str] = ""
    needs: ClassVar[StatsNeeds] = StatsNeeds()
    compresses: ClassVar[bool] = True
    decay: ClassVar[float] = 1.0

    budget: float = 0.25
    sink_tokens: int = 4
    window_tokens: int = 16
    evict_every: int = 0
    cold_bits: int = 0

    def __post_init__(self) -> None:
        if not self.budget > 0:
            raise ValueError(f"budget must be > 0 (a fraction <= 1 or a token count), got {self.budget}")
        if self.budget > 1 and self.budget != int(self.budget):
            raise ValueError(f"a token budget must be an integer, got {self.budget}")
        for name in ("sink_tokens", "window_tokens", "evict_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.cold_bits not in (0, 4, 8):
            raise ValueError(f"cold_bits must be 0 (drop), 4 or 8, got {self.cold_bits}")

    # ---- the one method a scoring policy implements ----------------------------------------
    def score(self, view: LayerView) -> torch.Tensor:
        """(n,) importance of each entry of ``view``; the highest are kept. Must not modify."""
        raise NotImplementedError

    # ---- plumbing shared by all policies ---------------------------------------------------
    def budget_tokens(self, num_prompt_tokens: int) -> int:
        """Tokens per layer this sequence may hold (at least sinks + window + 1)."""
        floor = self.sink_tokens + self.window_tokens + 1
        if self.budget <= 1:
            return max(floor, math.floor(self.budget * num_prompt_tokens))
        return max(floor, int(self.budget))

    def max_pool_tokens(self, num_prompt_tokens: int) -> int:
        """Most pool slots a sequence under this policy holds at once: its whole prompt plus
        the next token's slot at the end of prefill (compression starts once the prompt is
        computed), then at most its budget plus ``evict_every`` slack plus the token being
        decoded. The admission check's bound (``Scheduler.peak_tokens``)."""
        kept = self.budget_tokens(num_prompt_tokens) + self.evict_every + 1
        return max(num_prompt_tokens + 1, kept)

    def min_charge_tokens(self, state: SequenceKV, num_tokens: int) -> int:
        """Pool slots that the charge for what the policy keeps outside the pool
        (``SequenceKV.charge_blocks``) takes at least, once a sequence of ``num_tokens``
        tokens in all (prompt and output) has been compressed. Part of the admission check's
        bound (``Scheduler.peak_tokens``). By default the codes of the evicted tokens
        (``evicted_codes``: every token past the budget and its ``evict_every`` slack); 0
        for a policy that keeps none."""
        codes = self.evicted_codes(state)
        if codes is None:
            return 0
        from cache_node.kv_pool import KVPool
        from cache_node.policies.quant import code_bytes_per_token

        pool = state.pool
        evicted = max(0, num_tokens - self.budget_tokens(state.seq.num_prompt_tokens) - self.evict_every - 1)
        per_token = code_bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, *codes)
        token = KVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.kv.dtype)
        return math.ceil(evicted * per_token / token)

    def evicted_codes(self, state: SequenceKV) -> tuple[int, int] | None:
        """(bits, group size) of the codes the evicted tokens are kept as on the device (the
        cold tier: ``cold_bits``, ``SequenceKV._to_cold_tier``); None when they are dropped."""
        return (self.cold_bits, min(32, state.pool.head_dim)) if self.cold_bits else None

    def layer_budgets(self, budget_tokens: int, num_layers: int) -> list[int]:
        """Per-layer budgets (uniform by default; bytes held follow the largest)."""
        return [budget_tokens] * num_layers

    def protected(self, view: LayerView) -> torch.Tensor:
        """(n,) bool: sinks and the most recent ``window_tokens`` tokens (``protected_mask``)."""
        return protected_mask(view.positions, self.sink_tokens, self.window_tokens)

    def plan(self, view: LayerView, budget: int) -> LayerPlan:
        """Keep the top ``budget`` entries by score (protected first), in slot order."""
        n = view.positions.shape[0]
        if n <= budget:
            return LayerPlan(torch.arange(n, device=view.positions.device))
        score = self.score(view).float().clone()
        score[self.protected(view)] = float("inf")
        return LayerPlan(top_k_stable(score, budget).sort().values)

    # ---- hooks for transforming policies (no-ops by default) -------------------------------
    def before_attend(self, state: SequenceKV, layer_idx: int, q: torch.Tensor, q_pos: torch.Tensor) -> None:
        """Called before layer ``layer_idx`` attends with queries ``q`` (n, H, d); may recall KV."""

    def prompt_span(self, state: SequenceKV) -> int:
        """Chunk invariance for a policy whose attention depends on the step's queries (the
        KV ``before_attend`` selects from them). 0 (the default): none needed. ``w`` > 0:
        while the prompt is prefilled, ``SequenceKV.attend`` cuts the step's queries into
        spans at the absolute positions ``P - w``, ``P - 2w``, ... (``P`` the prompt's
        length; ``query_spans``: the last span is the prompt's last ``w`` tokens, the query
        the first output token is sampled from among them), each span's queries attending after their own
        ``before_attend``; and the scheduler ends a prompt chunk only at such a cut
        (``Sequence.chunk_tokens``), so no span is ever split across steps. The tokens a
        request decodes then do not depend on how its prompt was chunked, i.e. on
        ``max_num_batched_tokens`` or on the other requests sharing its steps (chunked
        prefill: Agrawal et al., Sarathi-Serve, OSDI'24; vLLM's scheduler, which chunks a
        prompt by what the step's token budget leaves)."""
        return 0

    def query_spans(self, state: SequenceKV, num_queries: int) -> list[int] | None:
        """For a step's ``num_queries`` queries from absolute position
        ``state.seq.num_computed_tokens``: None when they attend together (a decode step,
        or ``prompt_span`` 0); else the indices before which they are cut into spans
        (``prompt_span``; [] = one span, still attended apart from the step's fused paths, so
        a span gets the same arithmetic whatever else its step computes)."""
        span, seq = self.prompt_span(state), state.seq
        start, end = seq.num_computed_tokens, seq.num_prompt_tokens
        if not span or start >= end:
            return None
        return list(range((end - start) % span or span, num_queries, span))

    def span_scope(self, state: SequenceKV, layer_idx: int) -> contextlib.AbstractContextManager[None]:
        """A context around layer ``layer_idx``'s spans of one step (``query_spans``), in which
        the policy may keep what its ``before_attend`` prepares once for all of them (the
        same values: a span's arithmetic must not change). None kept by default."""
        return contextlib.nullcontext()

    def extra_kv(self, state: SequenceKV, layer_idx: int) -> ExtraKV | None:
        """KV outside the pool that layer ``layer_idx`` also attends to (None = none): by
        default the cold tier's codes (``cold_bits``)."""
        cold = state.extra.get("cold")
        return None if cold is None else cold.layer(layer_idx)

    def compress(self, state: SequenceKV) -> bool:
        """Bring every layer within budget. Returns True when the KV layout changed."""
        return state.compress_by_plans(self)

    def extra_device_bytes(self, state: SequenceKV) -> int:
        """Device-tier bytes held outside the pool blocks (quantized codes, sentence index)."""
        cold = state.extra.get("cold")
        return 0 if cold is None else cold.nbytes

    def private_host_bytes(self, state: SequenceKV) -> int:
        """Host RAM the policy holds for the sequence that no tier budget counts (charged to the
        device pool instead, ``SequenceKV.settle_charge``). 0 by default."""
        return 0

    def lost_tokens(self, state: SequenceKV) -> int:
        """Tokens whose KV ``state`` lost for want of room rather than by the policy's choice
        (its forks' losses included): the state attends other KV than the policy meant to
        keep, so whoever hands it on must say so (``CompressedPrefixCache.store`` stores no
        such state; ``SequenceKV.fork`` marks the child). 0 by default: a scoring policy's
        evictions are its choice, and the codes of the cold tier (``cold_bits``) and of
        ``quant`` stay on the device, charged to the pool (``charge_debt`` when it is short),
        never dropped."""
        return 0

    def host_slots(self, state: SequenceKV) -> int:
        """Host-tier slots the policy reserves for the sequence (``TierManager.reserve_host``;
        freed by ``release``). 0 by default."""
        return 0

    def release(self, state: SequenceKV) -> None:
        """The sequence's KV is gone (finish, abort, preemption): free what the policy holds
        outside the pool (host-tier slots). No-op by default."""

    def clone_state(self, state: SequenceKV) -> dict[str, Any]:
        """Copy of the policy-owned per-sequence state (``state.extra``) for forking."""
        return dict(state.extra)
