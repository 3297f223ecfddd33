"""SentenceKV: sentence-level semantic KV caching with recall from the host tier.

Device tier per sequence and layer::

    pool blocks:    | sinks | window | new ... |
    recall region:  (H_kv, R) slots: each KV head's promoted sentences (attended as extra KV),
                    as int8 codes with per-group scales by default (``region_bits``)
    sentence index: a 2-bit key sketch of every demoted token (or one mean key per sentence)

Every token outside sinks and the recent window is grouped into sentences; a sentence's raw
K/V goes to the engine's host tier (slots the sequence reserves there, counted in the host
budget and freed with the sequence; its own CPU tensors when the engine has no host tier,
charged to the device pool then) and only its index stays on the device tier (index and
region are charged to the pool as whole blocks: ``SequenceKV.charge_blocks``). Before each layer attends,
the step's queries score every sentence per KV head (best over the step's queries and the
head's query group) and each head promotes its best sentences into its own R region slots; in
a multi-token chunk the last query (the one sampled from) picks first, up to
``last_query_share`` of R. KV is copied from the host only for heads whose selection changed;
decoding one token per step, recall follows every decode step. Budget = the pool blocks (sinks
+ window + one block of headroom) + R + the index, in token-equivalent bytes.

Recall region precision (``region_bits``): 8 (default) or 4 quantizes each promoted token's K/V
per KV head and group of ``region_group`` channels (asymmetric, float16 scale and zero) as it
is copied in, and attention runs on the codes (HACK §4), so the bytes left for the region hold
3.2x (int8) or 5.3x (int4) the tokens of float32 K/V; sinks and the window stay in full
precision (KIVI §3). 0 keeps the pool's dtype (the paper's setting). A sentence is quantized
once, as it is demoted: its codes wait in host RAM beside its raw K/V (charged to the host
tier) and a promotion copies them. On SmolLM2-135M with 512-token
Wikipedia contexts at a 25% budget, mean KL against the full cache fell from 0.167 (float32
region) to 0.019 (int8) (bench/README.md).

Scoring (``select_mode``):
- ``"sketch"`` (default): the log of the softmax mass a sentence's tokens would receive,
  ``logsumexp_t(scaling * q . k_t)``, computed on 2-bit per-token key codes with per-group
  scales (``q . k = sum_g s_g (q_g . c_g) + z_g sum(q_g)``: on the codes, as in HACK §4). A
  sketch token costs 1/16 of a token's fp32 KV. This departs from the paper's scorer: on
  SmolLM2-135M with 1k-token Wikipedia contexts at a 25% budget, ``cos(q, mean_key)`` selection
  gave mean KL 0.23-0.26 against the full cache, sketch selection 0.02 (bench/README.md).
- ``"cos"``: ``cos(q, mean_key)`` with one mean key per sentence, layer and KV head (the
  paper's §3.3); FAISS inner-product shortlist when the candidate set is large.
- ``"mass"``: ``scaling * q . mean_key + log(len)``; ``"mean"``: cos with the chunk's mean query.

Sources: Zhu et al., "SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV
Caching" (arXiv 2504.00970), §3.2 (sentence-level compression at prefill: semantic vectors on
GPU, token KV offloaded to CPU) and §3.3 (decode: select sentences by query similarity and load
their KV); Zhang et al., "HACK" (arXiv 2502.03589) §4 (attention scores on quantized codes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from cache_node.attention_stats import StatsNeeds
from cache_node.compaction import can_rewrite, gather_kv
from cache_node.kv_pool import KVPool
from cache_node.policies.base import Policy, protected_mask
from cache_node.policies.quant import QuantLayerKV, pack_bits, quantize, unpack_bits
from cache_node.policies.registry import register

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV
    from cache_node.tiering import TierManager

FAISS_MIN_SENTENCES = 2048


class KeySketch:
    """Low-bit codes of every demoted token's key, for scoring sentences on the device tier.

    ``codes``: (L, N, H_kv, d * bits / 8) uint8 packed; ``scale``/``zero``: (L, N, H_kv,
    d / group_size) float16 (asymmetric per token, KV head and channel group);
    ``sentence_of``: (N,) the sentence each token belongs to.
    """

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.sentence_of = torch.zeros(0, dtype=torch.long)

    def append(self, keys: torch.Tensor, sentence: int) -> None:
        """Add one sentence's keys (L, n, H_kv, d)."""
        codes, scale, zero = quantize(keys.float(), self.bits, self.group_size)
        parts = (pack_bits(codes, self.bits), scale, zero)
        if self.codes is None:
            self.codes, self.scale, self.zero = parts
        else:
            self.codes, self.scale, self.zero = (
                torch.cat([old, new], 1) for old, new in zip((self.codes, self.scale, self.zero), parts)
            )
        self.sentence_of = torch.cat([self.sentence_of, torch.full((keys.shape[1],), sentence)])

    def fork(self) -> KeySketch:
        """A copy sharing the (never mutated in place) tensors."""
        out = KeySketch(self.bits, self.group_size)
        out.codes, out.scale, out.zero, out.sentence_of = self.codes, self.scale, self.zero, self.sentence_of
        return out

    @property
    def nbytes(self) -> int:
        if self.codes is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def log_mass(self, layer: int, q: torch.Tensor, scaling: float, num_sentences: int) -> torch.Tensor:
        """(n, H_kv, g, S) ``logsumexp`` over each sentence's tokens of ``scaling * q . k``.

        ``q``: (n, H, d). Scores come from the codes: ``q . k = sum_g s_g (q_g . c_g) +
        z_g sum(q_g)``, never a dequantized key tensor.
        """
        assert self.codes is not None and self.scale is not None and self.zero is not None
        n, h, d = q.shape
        codes = unpack_bits(self.codes[layer], self.bits).float()  # (N, H_kv, d)
        h_kv = codes.shape[1]
        qg = q.float().view(n, h_kv, h // h_kv, d // self.group_size, self.group_size)
        dots = torch.einsum("nhqGs,NhGs->nhqNG", qg, codes.view(*codes.shape[:2], -1, self.group_size))
        logits = (dots * self.scale[layer].float().permute(1, 0, 2).unsqueeze(0).unsqueeze(2)).sum(-1)
        logits = logits + torch.einsum("nhqG,NhG->nhqN", qg.sum(-1), self.zero[layer].float())
        logits = logits * scaling
        top = logits.amax(-1, keepdim=True)
        mass = torch.zeros((*logits.shape[:3], num_sentences)).index_add_(-1, self.sentence_of, (logits - top).exp())
        return mass.log() + top


class SentenceCodes:
    """The recall region's int8/int4 codes of every demoted token, quantized once as its
    sentence is demoted and kept in host RAM next to the raw K/V, so a promotion copies codes
    instead of quantizing again (``region_bits``).

    ``codes``: (L, N, 2, H_kv, d * bits / 8) uint8 packed; ``scale``/``zero``: (L, N, 2, H_kv,
    d / group_size) float16 (asymmetric per token, K or V, KV head and channel group);
    ``starts[s]``: the first of sentence ``s``'s tokens along N.
    """

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.starts: list[int] = []
        self.num_tokens = 0

    def quantize(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes, scale and zero of ``kv`` (L, n, 2, H_kv, d), not yet stored."""
        codes, scale, zero = quantize(kv.float(), self.bits, self.group_size)
        return pack_bits(codes, self.bits), scale, zero

    @staticmethod
    def nbytes_of(parts: tuple[torch.Tensor, ...]) -> int:
        return sum(t.numel() * t.element_size() for t in parts)

    def append(self, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Store one sentence's ``quantize`` output."""
        self.starts.append(self.num_tokens)
        self.num_tokens += parts[0].shape[1]
        if self.codes is None:
            self.codes, self.scale, self.zero = parts
        else:
            self.codes, self.scale, self.zero = (
                torch.cat([old, new], 1) for old, new in zip((self.codes, self.scale, self.zero), parts)
            )

    def tokens(self, sid: int, length: int) -> torch.Tensor:
        """(length,) indices along N of sentence ``sid``'s tokens."""
        return torch.arange(self.starts[sid], self.starts[sid] + length)

    def read(self, tokens: torch.Tensor, layer: int, head: int) -> tuple[torch.Tensor, ...]:
        """Codes (n, 2, d * bits / 8), scale and zero (n, 2, d / group_size) of ``tokens``."""
        assert self.codes is not None and self.scale is not None and self.zero is not None
        return tuple(t[layer, tokens, :, head] for t in (self.codes, self.scale, self.zero))

    def fork(self) -> SentenceCodes:
        """A copy sharing the (never mutated in place) tensors."""
        out = SentenceCodes(self.bits, self.group_size)
        out.codes, out.scale, out.zero = self.codes, self.scale, self.zero
        out.starts, out.num_tokens = list(self.starts), self.num_tokens
        return out

    @property
    def nbytes(self) -> int:
        return 0 if self.codes is None else self.nbytes_of((self.codes, self.scale, self.zero))  # type: ignore[arg-type]


class PrivateHostKV:
    """Sentence K/V in the sequence's own CPU tensors (used when the engine has no host tier)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def add(self, kv: torch.Tensor, extra_bytes: int = 0) -> int | None:
        """Store ``kv`` (L, n, 2, H_kv, d); returns its handle. ``extra_bytes`` (host RAM the
        caller keeps beside it) needs no reservation here."""
        self.parts.append(kv.to("cpu", copy=True))
        return len(self.parts) - 1

    def read(self, handle: int, layer: int, head: int | None = None) -> torch.Tensor:
        """(n, 2, H_kv, d) of one stored sentence in ``layer``; (n, 2, d) for one ``head``."""
        kv = self.parts[handle][layer]
        return kv if head is None else kv[:, :, head]

    def fork(self) -> PrivateHostKV:
        out = PrivateHostKV()
        out.parts = list(self.parts)  # never mutated in place
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    def release(self) -> None:
        self.parts = []


class TierHostKV:
    """Sentence K/V in host-tier slots the sequence reserves (``TierManager.reserve_host``),
    packed token after token: stored token ``t`` lives in slot ``slots[t // block_size]`` at
    offset ``t % block_size``. Host RAM the sequence keeps beside them (the recall region's
    codes) is charged as whole slots more (``charge_slots``, left empty). All of them count
    against the host tier's budget and leave it when the sequence's KV is released."""

    def __init__(self, tiers: TierManager) -> None:
        self.tiers = tiers
        self.block_size = tiers.pool.block_size
        data = tiers.host.data  # (L, 2, slots, block_size, H_kv, d)
        self.slot_bytes = data[:, :, :1].numel() * data.element_size()
        self.slots = torch.zeros(0, dtype=torch.long)
        self.charge_slots: list[int] = []
        self.charged_bytes = 0
        self.num_tokens = 0

    def add(self, kv: torch.Tensor, extra_bytes: int = 0) -> torch.Tensor | None:
        """Store ``kv`` (L, n, 2, H_kv, d) and charge ``extra_bytes`` of host RAM kept beside it;
        returns its handle (the stored token indices), or None when the host tier cannot hold
        both (nothing stored or charged)."""
        n = kv.shape[1]
        need = max(0, math.ceil((self.num_tokens + n) / self.block_size) - len(self.slots))
        charge = max(0, math.ceil((self.charged_bytes + extra_bytes) / self.slot_bytes) - len(self.charge_slots))
        if need + charge > 0:
            got = self.tiers.reserve_host(need + charge)
            if got is None:
                return None
            self.slots = torch.cat([self.slots, torch.tensor(got[:need], dtype=torch.long)])
            self.charge_slots.extend(got[need:])
        self.charged_bytes += extra_bytes
        t = torch.arange(self.num_tokens, self.num_tokens + n)
        self.num_tokens += n
        data = self.tiers.host.data  # (L, 2, slots, block_size, H_kv, d)
        data[:, :, self.slots[t // self.block_size], t % self.block_size] = kv.transpose(1, 2).to(data)
        return t

    def read(self, handle: torch.Tensor, layer: int, head: int | None = None) -> torch.Tensor:
        """(n, 2, H_kv, d) of the stored tokens ``handle`` in ``layer``; (n, 2, d) for one
        ``head`` (only that head's bytes are gathered)."""
        data = self.tiers.host.data[layer]  # (2, slots, block_size, H_kv, d)
        slots, offsets = self.slots[handle // self.block_size], handle % self.block_size
        kv = data[:, slots, offsets] if head is None else data[:, slots, offsets, head]
        return kv.transpose(0, 1)

    def fork(self) -> TierHostKV:
        """A copy in slots of its own (same handles, same charge). Raises RuntimeError when the
        host tier is full."""
        out = TierHostKV(self.tiers)
        if self.num_tokens:
            t = torch.arange(self.num_tokens)
            data = self.tiers.host.data[:, :, self.slots[t // self.block_size], t % self.block_size]
            if out.add(data.transpose(1, 2), self.charged_bytes) is None:
                raise RuntimeError("host tier full: cannot fork a sequence's sentences")
        return out

    def release(self) -> None:
        held = self.slots.tolist() + self.charge_slots
        if held:
            self.tiers.release_host(held)
        self.slots, self.num_tokens = torch.zeros(0, dtype=torch.long), 0
        self.charge_slots, self.charged_bytes = [], 0


@dataclass
class HostSentenceStore:
    """Sentences demoted to host RAM, their device-tier index, and the recall region.

    ``host``: where the sentences' raw K/V lives (the engine's host tier, or the sequence's own
    CPU tensors without one); ``handles[s]`` finds sentence ``s`` there. Index (device tier):
    ``sketch`` (key codes, ``select_mode="sketch"``) or ``mean_keys`` (S, L, H_kv * d) float32
    (the other modes). ``region_kv``: (L, 2, H_kv, R, d) the promoted sentences' K/V on the
    pool's device, each KV head its own (``region_positions`` (L, H_kv, R), -1 = empty slot);
    with ``region_bits`` 8 or 4 it holds codes (L, 2, H_kv, R, d * bits / 8) uint8 instead,
    with ``region_scale``/``region_zero`` (L, 2, H_kv, R, d / group) float16, copied from
    ``codes`` (every demoted token's codes, quantized once at demotion, host RAM).
    ``dropped_tokens``: tokens demoted while the host tier was full (lost, as on eviction).
    """

    host: PrivateHostKV | TierHostKV = field(default_factory=PrivateHostKV)
    sketch: KeySketch | None = None
    positions: list[torch.Tensor] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    mean_keys: torch.Tensor | None = None
    region_kv: torch.Tensor | None = None
    region_positions: torch.Tensor | None = None
    region_scale: torch.Tensor | None = None
    region_zero: torch.Tensor | None = None
    codes: SentenceCodes | None = None
    resident: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)  # layer -> per head
    recall_s: float = 0.0
    num_recalls: int = 0
    dropped_tokens: int = 0

    def put(self, kv: torch.Tensor, positions: torch.Tensor) -> bool:
        """Demote one sentence: ``kv`` (L, n, 2, H_kv, d) at ``positions`` (n,). False when the
        host tier is full (the sentence is dropped)."""
        parts = None if self.codes is None else self.codes.quantize(kv)
        handle = self.host.add(kv, 0 if parts is None else SentenceCodes.nbytes_of(parts))
        if handle is None:
            self.dropped_tokens += len(positions)
            return False
        if parts is not None:
            assert self.codes is not None
            self.codes.append(parts)
        if self.sketch is not None:
            self.sketch.append(kv[:, :, 0], len(self.handles))
        else:
            mk = kv[:, :, 0].float().mean(1).flatten(-2).unsqueeze(0)  # (1, L, H_kv * d)
            self.mean_keys = mk if self.mean_keys is None else torch.cat([self.mean_keys, mk])
        self.handles.append(handle)
        self.positions.append(positions.clone())
        return True

    def sentence_kv(self, sid: int, layer: int, head: int | None = None) -> torch.Tensor:
        """(n, 2, H_kv, d) raw K/V of sentence ``sid`` in ``layer``, read from the host."""
        return self.host.read(self.handles[sid], layer, head)

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def index_nbytes(self) -> int:
        """Device-tier bytes of the sentence index (sketch or mean keys)."""
        if self.sketch is not None:
            return self.sketch.nbytes
        return 0 if self.mean_keys is None else self.mean_keys.numel() * self.mean_keys.element_size()

    @property
    def region_tokens(self) -> int:
        """R: the region's slots per layer and KV head."""
        return 0 if self.region_positions is None else self.region_positions.shape[-1]

    @property
    def region_nbytes(self) -> int:
        """Device bytes of the region (codes and scales included; every slot, filled or not)."""
        parts = (self.region_kv, self.region_scale, self.region_zero)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def resize_region(self, r: int, like: torch.Tensor, bits: int = 0, group_size: int = 16) -> None:
        """An empty region of ``r`` slots per layer and KV head; ``like``: (L, 2, S, H_kv, d)
        the pool tensor (dtype, device, shape); ``bits`` 0 keeps the pool's dtype, 8 or 4
        holds codes with per-``group_size`` scales."""
        num_layers, _, _, h_kv, d = like.shape
        self.region_positions = torch.full((num_layers, h_kv, r), -1, dtype=torch.long)
        self.region_scale = self.region_zero = None
        if bits:
            shape = (num_layers, 2, h_kv, r)
            self.region_kv = torch.zeros((*shape, d * bits // 8), dtype=torch.uint8, device=like.device)
            self.region_scale = torch.zeros((*shape, d // group_size), dtype=torch.float16,
                                            device=like.device)
            self.region_zero = torch.zeros_like(self.region_scale)
        else:
            self.region_kv = torch.zeros((num_layers, 2, h_kv, r, d), dtype=like.dtype, device=like.device)
        self.resident.clear()

    def fork(self) -> HostSentenceStore:
        """An independent copy (host K/V, index and region copied or shared immutably)."""
        sketch = None if self.sketch is None else self.sketch.fork()
        region, region_pos, scale, zero = (
            None if t is None else t.clone()
            for t in (self.region_kv, self.region_positions, self.region_scale, self.region_zero)
        )
        codes = None if self.codes is None else self.codes.fork()
        return HostSentenceStore(self.host.fork(), sketch, list(self.positions), list(self.handles),
                                 self.mean_keys, region, region_pos, scale, zero, codes, dict(self.resident),
                                 self.recall_s, self.num_recalls, self.dropped_tokens)


class SentenceRegion:
    """One layer's recall region as extra KV (``Policy.extra_kv``): each KV head attends to its
    own promoted sentences; empty slots are masked out."""

    def __init__(self, store: HostSentenceStore, layer_idx: int) -> None:
        assert store.region_kv is not None and store.region_positions is not None
        self.k, self.v = store.region_kv[layer_idx, 0], store.region_kv[layer_idx, 1]  # (H_kv, R, d)
        self.empty = (store.region_positions[layer_idx] < 0).to(self.k.device)  # (H_kv, R)

    def logits(self, qh: torch.Tensor, scaling: float) -> torch.Tensor:
        scores = qh @ self.k.to(qh.dtype).transpose(1, 2).unsqueeze(1) * scaling  # (H_kv, g, n, R)
        return scores.masked_fill(self.empty[:, None, None, :], float("-inf"))

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        return probs @ self.v.to(probs.dtype).unsqueeze(1)  # (H_kv, g, n, d)


class QuantSentenceRegion:
    """A recall region held as int8/int4 codes (``region_bits``), attended on the codes as in
    HACK §4 (``quant.QuantLayerKV``, each KV head its own slots); empty slots are masked out."""

    def __init__(self, store: HostSentenceStore, layer_idx: int, bits: int) -> None:
        assert store.region_kv is not None and store.region_positions is not None
        assert store.region_scale is not None and store.region_zero is not None
        codes, scale, zero = (t[layer_idx].transpose(1, 2) for t in  # (2, R, H_kv, ...)
                              (store.region_kv, store.region_scale, store.region_zero))
        self.kv = QuantLayerKV(codes, scale, zero, bits)
        self.empty = (store.region_positions[layer_idx] < 0).to(codes.device)  # (H_kv, R)

    def logits(self, qh: torch.Tensor, scaling: float) -> torch.Tensor:
        return self.kv.logits(qh, scaling).masked_fill(self.empty[:, None, None, :], float("-inf"))

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        return self.kv.output(probs)


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
    """See the module docstring.

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
                out.append(torch.arange(start, i + 1))
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
        state.set_layout(kept, positions, torch.ones(positions.shape))
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
        lengths = torch.tensor([len(p) for p in store.positions])
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
        for head, sids in enumerate(chosen):
            if before is None or before[head] != sids:
                self._load(store, layer_idx, head, sids)
        store.resident[layer_idx] = chosen
        store.recall_s += time.perf_counter() - t0
        store.num_recalls += 1

    def select(self, store: HostSentenceStore, scores: list[torch.Tensor], r: int,
               cand: torch.Tensor | None = None) -> tuple[tuple[int, ...], ...]:
        """Per KV head, the sentences that fit that head's ``r`` slots, best first, returned in
        position order. With two score sets (the chunk's last query, then all its queries),
        the first may fill ``last_query_share`` of ``r``.
        ``scores``: list of (H_kv, S) over all sentences, or over the shortlist ``cand``."""
        lengths = [len(p) for p in store.positions]
        caps = [int(self.last_query_share * r), r] if len(scores) == 2 else [r]
        out = []
        for head in range(scores[0].shape[0]):
            chosen: dict[int, None] = {}
            used = 0
            for sc, cap in zip(scores, caps):
                ranked = sc[head].argsort(descending=True)
                for sid in (ranked if cand is None else cand[ranked]).tolist():
                    if sid not in chosen and used + lengths[sid] <= cap:
                        chosen[sid] = None
                        used += lengths[sid]
            out.append(tuple(sorted(chosen, key=lambda s: int(store.positions[s][0]))))
        return tuple(out)

    def _load(self, store: HostSentenceStore, layer: int, head: int, sids: tuple[int, ...]) -> None:
        """Copy head ``head``'s sentences ``sids`` from host RAM into its region slots."""
        assert store.region_kv is not None and store.region_positions is not None
        pos = store.region_positions[layer, head]
        pos.fill_(-1)
        if not sids:
            return
        if store.codes is not None:  # copy the codes made at demotion
            assert store.region_scale is not None and store.region_zero is not None
            tokens = torch.cat([store.codes.tokens(s, len(store.positions[s])) for s in sids])
            n = len(tokens)
            codes, scale, zero = store.codes.read(tokens, layer, head)  # (n, 2, ...)
            for dst, src in zip((store.region_kv, store.region_scale, store.region_zero), (codes, scale, zero)):
                dst[layer, :, head, :n] = src.transpose(0, 1).to(dst.device)
        else:
            kv = torch.cat([store.sentence_kv(s, layer, head) for s in sids])  # (n, 2, d)
            n = kv.shape[0]
            store.region_kv[layer, :, head, :n] = kv.transpose(0, 1).to(store.region_kv)
        pos[:n] = torch.cat([store.positions[s] for s in sids])

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
