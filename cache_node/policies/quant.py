"""Quantized tier: older tokens' KV as int8/int4 codes with per-group scales, attended on codes.

Sinks and the recent window stay in full precision in the pool blocks; every other token is
quantized once (asymmetric min/max per token, KV head and channel group of ``group_size``) into
a per-sequence segment on the device tier. Attention never dequantizes a tensor: with
``k ~ s * c + z`` per group, ``q . k = sum_g s_g (q_g . c_g) + z_g sum(q_g)`` and
``sum_t p_t v_t = sum_t (p_t s_t) c_t + sum_t p_t z_t``, so the matmuls run on the integer
codes and the scales/zero points are applied to partial sums.

Source: Zhang et al., "HACK: Homomorphic Acceleration via Compression of the Key-Value Cache
for Disaggregated LLM Inference" (arXiv 2502.03589), §4 (homomorphic quantization: attention
on quantized K/V with the dequantization folded into the partial sums); sink/recent tokens in
full precision follow KIVI (arXiv 2402.02750) §3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cache_node.compaction import gather_kv
from cache_node.policies.base import LayerPlan, Policy, protected_mask
from cache_node.policies.registry import register

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV


def channel_group(group_size: int, channels: int) -> int:
    """The channel group a policy's ``group_size`` gives over ``channels`` channels: their
    greatest common divisor, so groups always tile the channels (``min(group_size, channels)``
    for the power-of-two sizes of heads and presets; a spec's odd size cannot break a
    quantizer). ``group_size`` must be >= 1."""
    return math.gcd(group_size, channels)


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-group quantization along the last dim.

    Args:
        x: (..., d) float.

    Returns:
        codes (..., d) uint8 in [0, 2**bits - 1]; scale and zero (..., d // group_size) float16.
    """
    g = x.float().unflatten(-1, (-1, group_size))
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-6).half()
    zero = lo.half()
    codes = ((g - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round().clamp(0, 2**bits - 1)
    return codes.flatten(-2).to(torch.uint8), scale, zero


def code_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bits: int, group_size: int) -> int:
    """Bytes one token's K and V take as codes in every layer and KV head (``QuantSegment``,
    ``ColdTier``): ``head_dim * bits / 8`` code bytes plus a float16 scale and zero per group
    of ``group_size`` channels."""
    return num_layers * 2 * num_kv_heads * (head_dim * bits // 8 + 4 * math.ceil(head_dim / group_size))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., d) uint8 codes < 2**bits -> (..., d * bits // 8) uint8; code ``j`` of each byte's
    group sits at bit ``bits * j``. ``bits``: 1, 2, 4 or 8."""
    per_byte = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes.unflatten(-1, (-1, per_byte)) << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_bits``."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2)


_DECODE_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def decode_table(bits: int, device: torch.device) -> torch.Tensor:
    """(256, 8 / bits) float32: the codes packed in each byte value (``unpack_bits`` of 0..255),
    one table per (bits, device), made once."""
    key = (bits, torch.device(device))
    table = _DECODE_TABLES.get(key)
    if table is None:
        table = _DECODE_TABLES[key] = unpack_bits(
            torch.arange(256, dtype=torch.uint8, device=device).unsqueeze(-1), bits).float()
    return table


def unpack_bits_float(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``unpack_bits(packed, bits).float()``: (..., d * bits / 8) uint8 -> (..., d) float32,
    the same values whichever way. 1- and 2-bit codes: one table lookup per byte
    (``decode_table``). 4-bit codes: a shift and a mask per half byte over the whole
    (contiguous) tensor, written straight into its float column: 2.6-3.7x faster than the
    lookup on this CPU at the sketch's sizes (3 KV heads x 1400 tokens x 16-32 bytes), where
    two codes a byte leave the lookup a gather per code; at 2 bits the lookup was faster."""
    if bits == 8:
        return packed.float()
    if bits != 4:
        return F.embedding(packed.int(), decode_table(bits, packed.device)).flatten(-2)
    src = packed.contiguous()
    out = torch.empty((*src.shape, 2), dtype=torch.float32, device=src.device)
    out[..., 0] = src & 15  # code 0 of a byte in its low half (``pack_bits``)
    out[..., 1] = src >> 4
    return out.flatten(-2)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., d) float32 ``scale * code + zero`` per group of ``packed`` (..., d * bits / 8) uint8
    codes (``pack_bits``) with ``scale``/``zero`` (..., d / group_size): the inverse of
    ``quantize`` up to its rounding. For a transient buffer (one layer's codes, attended and
    dropped); stored KV stays coded."""
    x = unpack_bits_float(packed, bits).unflatten(-1, (scale.shape[-1], -1))
    return x.mul_(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1)).flatten(-2)


# Query rows (queries x query heads per KV head) from which attention on grouped codes
# dequantizes the keys/values once into a transient buffer and takes one bmm: a long prefill
# chunk (a session turn or a prefix fork appending a document) would otherwise materialise a
# (rows, N, groups) product. Decode steps and short question chunks (< 171 tokens at 3 query
# heads per KV head) keep the computation on the codes (HACK §4).
DEQUANT_MIN_ROWS = 512
# Query rows from which SentenceKV's prompt spans (``cache_node.query_spans``: 16 queries at
# most, each span a fixed shape whatever the chunking) score its key sketch and attend its
# recalled region on dequantized keys and values: a span's rows would otherwise materialise the
# same (rows, N, groups) product per span, and the sketch's dequantized keys are kept for the
# layer's every span (``KeySketch.held``). A decode step's one query stays on the codes.
SPAN_DEQUANT_MIN_ROWS = 2


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(..., d) uint8 codes < 16 -> (..., d // 2) uint8, two codes per byte."""
    return pack_bits(codes, 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``."""
    return unpack_bits(packed, 4)


class QuantSegment:
    """A sequence's quantized tokens: codes (L, 2, N, H_kv, d * bits / 8) uint8, scale and zero
    (L, 2, N, H_kv, d / group_size) float16, positions (N,)."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.positions = torch.zeros(0, dtype=torch.long)

    def append(self, kv: torch.Tensor, positions: torch.Tensor) -> None:
        """Quantize ``kv`` (L, n, 2, H_kv, d) and add it."""
        codes, scale, zero = quantize(kv.transpose(1, 2), self.bits, self.group_size)
        if self.bits == 4:
            codes = pack_int4(codes)
        if self.codes is None:
            self.codes, self.scale, self.zero = codes, scale, zero
        else:
            self.codes = torch.cat([self.codes, codes], 2)
            self.scale = torch.cat([self.scale, scale], 2)  # type: ignore[list-item]
            self.zero = torch.cat([self.zero, zero], 2)  # type: ignore[list-item]
        self.positions = torch.cat([self.positions.to(positions.device), positions])

    def fork(self) -> QuantSegment:
        """A copy that shares the (never mutated in place) tensors."""
        out = QuantSegment(self.bits, self.group_size)
        out.codes, out.scale, out.zero, out.positions = self.codes, self.scale, self.zero, self.positions
        return out

    @property
    def nbytes(self) -> int:
        if self.codes is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))  # type: ignore[union-attr]

    def layer(self, layer_idx: int) -> QuantLayerKV:
        assert self.codes is not None and self.scale is not None and self.zero is not None
        return QuantLayerKV(self.codes[layer_idx], self.scale[layer_idx], self.zero[layer_idx], self.bits)


class QuantLayerKV:
    """One layer's quantized KV as ``ExtraKV``: scores and outputs computed on the codes.

    ``codes``: (2, N, H_kv, d * bits / 8) uint8 packed; ``scale``/``zero``: (2, N, H_kv,
    d / group_size) float16. Entry ``n`` of KV head ``h`` is its own token, so the N entries
    may differ per head (SentenceKV's per-head recall region).
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> None:
        self.scale, self.zero = scale.float(), zero.float()  # (2, N, H, k)
        # (2, N, H, k, G): integer values
        self.codes = unpack_bits_float(codes, bits).unflatten(-1, (self.scale.shape[-1], -1))

    def logits(self, qh: torch.Tensor, scaling: float, dequant_min_rows: int = DEQUANT_MIN_ROWS) -> torch.Tensor:
        """(H_kv, g, n, N) float32 ``scaling * q . k`` of ``qh`` (H_kv, g, n, d, any float
        dtype: taken as float32, as the codes' scales) on the codes; on the keys dequantized once
        from ``dequant_min_rows`` query rows (g n) with several groups.

        Regression: a query in the pool's bfloat16/float16 met the float32 codes in one bmm or
        einsum, which raised, so every ``quant`` and ``cold_bits`` request failed at its first
        step over the codes in those dtypes."""
        qh = qh.float()
        qg = qh.unflatten(-1, (self.codes.shape[-2], -1))  # (h, g, n, k, G)
        h, g, n, d = qh.shape
        if qg.shape[3] > 1 and g * n >= dequant_min_rows:  # a long chunk: dequantize once
            keys = self.dequantized(0)  # (h, N, d)
            return torch.bmm(qh.reshape(h, g * n, d), keys.transpose(1, 2)).view(h, g, n, -1) * scaling
        if qg.shape[3] == 1:  # one group per head: the einsum's product as one bmm over the heads
            keys = self.codes[0].flatten(-2).transpose(0, 1)  # (h, N, d)
            dots = torch.bmm(qh.reshape(h, g * n, d), keys.transpose(1, 2)).view(h, g, n, -1, 1)
        else:
            dots = torch.einsum("hgnkc,Nhkc->hgnNk", qg, self.codes[0])
        scale, zero = self.scale[0].permute(1, 0, 2), self.zero[0].permute(1, 0, 2)  # (h, N, k)
        out = (dots * scale[:, None, None]).sum(-1)
        out = out + torch.einsum("hgnk,hNk->hgnN", qg.sum(-1), zero)
        return out * scaling

    def dequantized(self, kv: int) -> torch.Tensor:
        """(H_kv, N, d) float32 keys (``kv`` 0) or values (1): ``scale * code + zero`` per group,
        a transient buffer for a long chunk (``DEQUANT_MIN_ROWS``)."""
        x = self.codes[kv] * self.scale[kv].unsqueeze(-1) + self.zero[kv].unsqueeze(-1)  # (N, H, k, G)
        return x.flatten(-2).transpose(0, 1)

    def output(self, probs: torch.Tensor, dequant_min_rows: int = DEQUANT_MIN_ROWS) -> torch.Tensor:
        """(H_kv, g, n, d) float32 ``sum_N probs v`` of ``probs`` (H_kv, g, n, N, any float
        dtype: taken as float32, as ``logits`` takes its query) on the codes (on the values
        dequantized once from ``dequant_min_rows`` rows, as ``logits``)."""
        probs = probs.float()
        h, g, n, num = probs.shape
        if self.codes.shape[-2] > 1 and g * n >= dequant_min_rows:  # a long chunk: dequantize once
            return torch.bmm(probs.reshape(h, g * n, num), self.dequantized(1)).view(h, g, n, -1)
        scale, zero = self.scale[1].permute(1, 0, 2), self.zero[1].permute(1, 0, 2)  # (h, N, k)
        ps = probs.unsqueeze(-1) * scale[:, None, None]  # (h, g, n, N, k)
        if ps.shape[-1] == 1:  # one group per head: one bmm over the heads
            h, g, n, num = probs.shape
            values = self.codes[1].flatten(-2).transpose(0, 1)  # (h, N, d)
            out = torch.bmm(ps.reshape(h, g * n, num), values).view(h, g, n, 1, -1)
        else:
            out = torch.einsum("hgnNk,Nhkc->hgnkc", ps, self.codes[1])
        out = out + torch.einsum("hgnN,hNk->hgnk", probs, zero).unsqueeze(-1)
        return out.flatten(-2)


class ColdTier:
    """The entries a scoring policy evicts, kept as int codes on the device tier instead of
    dropped (``Policy.cold_bits``) and attended on the codes like ``QuantizedTier``'s segment.
    One ``QuantSegment`` per layer, since layers evict different tokens."""

    def __init__(self, num_layers: int, bits: int, group_size: int) -> None:
        self.layers = [QuantSegment(bits, group_size) for _ in range(num_layers)]

    def append(self, layer_idx: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        """Quantize layer ``layer_idx``'s evicted entries ``kv`` (n, 2, H_kv, d) at ``positions`` (n,)."""
        self.layers[layer_idx].append(kv.unsqueeze(0).float(), positions)

    def fork(self) -> ColdTier:
        out = ColdTier(0, 0, 0)
        out.layers = [seg.fork() for seg in self.layers]
        return out

    @property
    def nbytes(self) -> int:
        return sum(seg.nbytes for seg in self.layers)

    def layer(self, layer_idx: int) -> QuantLayerKV | None:
        seg = self.layers[layer_idx]
        return None if seg.codes is None else seg.layer(0)


@register
@dataclass
class QuantizedTier(Policy):
    """Everything but sinks and the recent window becomes int8 (``bits=8``) or int4 codes.

    ``budget`` does not apply: the pool holds ``sink_tokens + window_tokens`` (+ up to
    ``evict_every``) tokens per layer, the quantized segment the rest; both count as device
    bytes. Tokens move to the codes a block at a time (``evict_every``).

    Keys a query attends: every earlier token and itself (nothing is dropped). Once the prompt
    is computed and the pool holds more than ``sink_tokens + window_tokens + evict_every``
    tokens, all but positions ``0 .. sink_tokens - 1`` and the ``window_tokens`` most recent
    move to the codes; a query at position ``p`` attends those full-precision keys, the tokens
    computed since, and the codes, all ``<= p``. ``window_tokens`` 0: only the sinks (and the
    tokens since the last move) stay in full precision.
    """

    name = "quant"
    bits: int = 8
    group_size: int = 32
    window_tokens: int = 32
    evict_every: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.cold_bits:
            raise ValueError("quant is itself the quantized tier; cold_bits does not apply")

    def budget_tokens(self, num_prompt_tokens: int) -> int:
        return self.sink_tokens + self.window_tokens

    def compress(self, state: SequenceKV) -> bool:
        if not state.over_budget():
            return False
        pos = state.positions[0]  # every layer holds the same tokens under this policy
        view_pos = pos[pos >= 0]
        keep_mask = protected_mask(view_pos, self.sink_tokens, self.window_tokens)
        old = (~keep_mask).nonzero().squeeze(1)
        if not len(old):
            return False  # nothing to move: the layout stays as it is
        slots = (pos >= 0).nonzero().squeeze(1)[old]
        data = gather_kv(state.pool, state.seq, slots.unsqueeze(0).expand(state.pool.num_layers, -1))
        seg = state.extra.setdefault("quant", QuantSegment(self.bits, self._group(state)))
        if not state.apply_plans([LayerPlan(keep_mask.nonzero().squeeze(1))] * state.pool.num_layers):
            return False
        seg.append(data.float(), view_pos[old])
        return True

    def _group(self, state: SequenceKV) -> int:
        return channel_group(self.group_size, state.pool.head_dim)

    def evicted_codes(self, state: SequenceKV) -> tuple[int, int] | None:
        return self.bits, self._group(state)

    def extra_kv(self, state: SequenceKV, layer_idx: int) -> QuantLayerKV | None:
        seg = state.extra.get("quant")
        return None if seg is None or seg.codes is None else seg.layer(layer_idx)

    def extra_device_bytes(self, state: SequenceKV) -> int:
        seg = state.extra.get("quant")
        return 0 if seg is None else seg.nbytes
