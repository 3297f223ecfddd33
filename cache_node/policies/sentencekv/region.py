"""SentenceKV's recall region: the int8/int4 codes of demoted tokens, made once at demotion
(``SentenceCodes``), and one layer's region attended as extra KV, in the pool's dtype
(``SentenceRegion``) or on the codes (``QuantSentenceRegion``, HACK §4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cache_node.policies.quant import (
    SPAN_DEQUANT_MIN_ROWS,
    QuantLayerKV,
    dequantize,
    pack_bits,
    quantize,
)

if TYPE_CHECKING:
    from cache_node.policies.sentencekv.store import HostSentenceStore


class SentenceCodes:
    """The recall region's int8/int4 codes of every demoted token, quantized once as its
    sentence is demoted and kept in host RAM next to the raw K/V, so a promotion copies codes
    instead of quantizing again (``region_bits``).

    ``codes``: (L, H_kv, N, 2, d * bits / 8) uint8 packed; ``scale``/``zero``: (L, H_kv, N, 2,
    d / group_size) float16 (asymmetric per token, K or V, KV head and channel group);
    ``starts[s]``: the first of sentence ``s``'s tokens along N. KV head before token, so one
    layer's codes are rows ``head * N + token`` of K and V together: a promotion gathers whole
    rows (``gather``).

    ``key_shift``/``key_scale`` (``region_key_scale``): (L, H_kv, d) float32 per-channel key
    centres and scales, fitted once (``fit_key_scale``) on the sequence's first demoted keys;
    keys are then quantized as ``(k - key_shift) / key_scale`` and the region's logits are
    ``q . key_shift + (q * key_scale) . code`` (the dot product is unchanged). Keys have outlier
    channels (KIVI §3: key outliers are per channel, a large offset or range in a few
    channels), which set a per-token group's range and leave the other channels few code
    levels; centring and scaling each channel first gives every channel of a group the same
    range, as KIVI's per-channel key quantization and SmoothQuant's scale migration do, while
    the codes stay per token (a sentence's tokens arrive together; per-channel groups would
    need a group of tokens).
    """

    def __init__(self, bits: int, group_size: int, key_scale: bool = False) -> None:
        self.bits, self.group_size, self.use_key_scale = bits, group_size, key_scale
        self.key_shift: torch.Tensor | None = None
        self.key_scale: torch.Tensor | None = None
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.starts: list[int] = []
        self.num_tokens = 0

    def fit_key_scale(self, keys: torch.Tensor) -> None:
        """Per-channel key centres and scales from ``keys`` (L, n, H_kv, d): each channel's
        midrange over the tokens and its half range (floored at 1e-3 of the head's largest, so
        a flat channel does not blow up the codes' range)."""
        if not self.use_key_scale or self.key_scale is not None:
            return
        k = keys.float()
        lo, hi = k.amin(1), k.amax(1)  # (L, H_kv, d)
        half = (hi - lo) / 2
        self.key_shift = (hi + lo) / 2
        self.key_scale = half.clamp(min=1e-6).maximum(1e-3 * half.amax(-1, keepdim=True))

    @property
    def key_affine(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key_shift, key_scale) once fitted, else None."""
        if self.key_shift is None or self.key_scale is None:
            return None
        return self.key_shift, self.key_scale

    def scaled(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` (L, n, 2, H_kv, d) float32 with the keys centred and scaled (if fitted)."""
        kv = kv.float()
        if self.key_affine is None:
            return kv
        shift, scale = (t.to(kv.device)[:, None] for t in self.key_affine)
        return torch.stack([(kv[:, :, 0] - shift) / scale, kv[:, :, 1]], 2)

    def quantize(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes, scale and zero (L, n, 2, H_kv, ...) of ``kv`` (L, n, 2, H_kv, d), not yet
        stored (keys divided by ``key_scale`` first, when fitted)."""
        codes, scale, zero = quantize(self.scaled(kv), self.bits, self.group_size)
        return pack_bits(codes, self.bits), scale, zero

    @staticmethod
    def nbytes_of(parts: tuple[torch.Tensor, ...]) -> int:
        return sum(t.numel() * t.element_size() for t in parts)

    def append(self, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Store one sentence's ``quantize`` output (moved to host RAM, where a promotion
        copies it from, KV head first)."""
        parts = tuple(t.permute(0, 3, 1, 2, 4).to("cpu").contiguous() for t in parts)  # type: ignore[assignment]
        self.starts.append(self.num_tokens)
        self.num_tokens += parts[0].shape[2]
        if self.codes is None:
            self.codes, self.scale, self.zero = parts
        else:
            self.codes, self.scale, self.zero = (
                torch.cat([old, new], 2) for old, new in zip((self.codes, self.scale, self.zero), parts)
            )

    def gather(self, rows: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        """Codes (n, 2, d * bits / 8), scale and zero (n, 2, d / group_size) of ``rows`` (n,)
        = ``head * N + token``: one row copy per token, for any mix of KV heads."""
        assert self.codes is not None and self.scale is not None and self.zero is not None
        return tuple(t[layer].flatten(0, 1).index_select(0, rows) for t in (self.codes, self.scale, self.zero))

    def fork(self) -> SentenceCodes:
        """A copy sharing the (never mutated in place) tensors."""
        out = SentenceCodes(self.bits, self.group_size, self.use_key_scale)
        out.codes, out.scale, out.zero = self.codes, self.scale, self.zero
        out.key_shift, out.key_scale = self.key_shift, self.key_scale
        out.starts, out.num_tokens = list(self.starts), self.num_tokens
        return out

    @property
    def nbytes(self) -> int:
        return 0 if self.codes is None else self.nbytes_of((self.codes, self.scale, self.zero))  # type: ignore[arg-type]

    @property
    def key_scale_nbytes(self) -> int:
        """Device bytes of ``key_shift`` and ``key_scale`` (the region's logits read them every step)."""
        return sum(t.numel() * t.element_size() for t in (self.key_shift, self.key_scale) if t is not None)


class SentenceRegion:
    """One layer's recall region as extra KV (``Policy.extra_kv``): each KV head attends to its
    own promoted sentences; empty slots are masked out."""

    def __init__(self, store: HostSentenceStore, layer_idx: int) -> None:
        assert store.region_kv is not None and store.region_positions is not None
        self.k, self.v = store.region_kv[layer_idx][0], store.region_kv[layer_idx][1]  # (H_kv, R_l, d)
        self.empty = (store.region_positions[layer_idx] < 0).to(self.k.device)  # (H_kv, R)

    def logits(self, qh: torch.Tensor, scaling: float) -> torch.Tensor:
        scores = qh @ self.k.to(qh.dtype).transpose(1, 2).unsqueeze(1) * scaling  # (H_kv, g, n, R)
        return scores.masked_fill(self.empty[:, None, None, :], float("-inf"))

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        return probs @ self.v.to(probs.dtype).unsqueeze(1)  # (H_kv, g, n, d)

    def dense_kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The region's K and V (H_kv, R, d) in ``dtype`` and its empty slots (H_kv, R)."""
        return self.k.to(dtype), self.v.to(dtype), self.empty


class QuantSentenceRegion:
    """A recall region held as int8/int4 codes (``region_bits``), attended on the codes as in
    HACK §4 (``quant.QuantLayerKV``, each KV head its own slots); empty slots are masked out.
    With per-channel key centres and scales (``SentenceCodes``) the query is scaled by them and
    ``q . key_shift`` added to every slot's logit.

    A decode query over a dense layout takes ``dense_kv`` instead: the layer's codes
    dequantized into a transient float buffer (the size of the float codes the code-domain
    path unpacks) and attended with the pool's K/V in one fused call. On this CPU a decode
    step's attention is a few hundred small ops, and the code-domain path's extra matmuls,
    scale and zero terms cost more than dequantizing ~100-400 slots per KV head; HACK's
    saving is memory traffic, which a GPU kernel gets by dequantizing in registers."""

    def __init__(self, store: HostSentenceStore, layer_idx: int, bits: int) -> None:
        assert store.region_kv is not None and store.region_positions is not None
        assert store.region_scale is not None and store.region_zero is not None
        self.bits = bits
        # (2, H_kv, R, d * bits / 8) uint8 codes, (2, H_kv, R, d / group) float16 scale and zero
        self.codes, self.scale, self.zero = (t[layer_idx] for t in
                                             (store.region_kv, store.region_scale, store.region_zero))
        self.empty = (store.region_positions[layer_idx] < 0).to(self.codes.device)  # (H_kv, R)
        affine = None if store.codes is None else store.codes.key_affine
        self.key_shift, self.key_scale = (None, None) if affine is None else (  # (H_kv, d) each
            t[layer_idx].to(self.codes.device) for t in affine)
        self._kv: QuantLayerKV | None = None

    @property
    def kv(self) -> QuantLayerKV:
        """The codes as ``QuantLayerKV`` (token before KV head), made on first use."""
        if self._kv is None:
            self._kv = QuantLayerKV(*(t.transpose(1, 2) for t in (self.codes, self.scale, self.zero)), self.bits)
        return self._kv

    def logits(self, qh: torch.Tensor, scaling: float) -> torch.Tensor:
        """(H_kv, g, n, R) float32 logits of ``qh`` (H_kv, g, n, d, any float dtype: taken as
        float32, key affine included) on the region's codes."""
        qh = qh.float()
        if self.key_scale is None or self.key_shift is None:
            out = self.kv.logits(qh, scaling, SPAN_DEQUANT_MIN_ROWS)
        else:
            shift, scale = (t[:, None, None, :].to(qh.dtype) for t in (self.key_shift, self.key_scale))
            base = (qh * shift).sum(-1, keepdim=True) * scaling  # (H_kv, g, n, 1)
            out = self.kv.logits(qh * scale, scaling, SPAN_DEQUANT_MIN_ROWS) + base
        return out.masked_fill(self.empty[:, None, None, :], float("-inf"))

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        return self.kv.output(probs, SPAN_DEQUANT_MIN_ROWS)

    def dense_kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K and V (H_kv, R, d) in ``dtype``, dequantized (keys scaled back and shifted by the
        per-channel key affine), and the empty slots (H_kv, R)."""
        kv = dequantize(self.codes, self.scale, self.zero, self.bits)  # (2, H_kv, R, d) float32
        k = kv[0]
        if self.key_scale is not None and self.key_shift is not None:
            k = k.mul_(self.key_scale[:, None]).add_(self.key_shift[:, None])
        return k.to(dtype), kv[1].to(dtype), self.empty
