"""SentenceKV's key sketch: low-bit codes of every demoted token's key, scored on the codes
(HACK §4) to rank sentences on the device tier; optionally of the key's coordinates in a
low-rank principal basis (Loki)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from cache_node.policies.quant import (
    SPAN_DEQUANT_MIN_ROWS,
    channel_group,
    dequantize,
    pack_bits,
    quantize,
    unpack_bits_float,
)


class KeySketch:
    """Low-bit codes of every demoted token's key, for scoring sentences on the device tier.

    ``codes``: (L, N, H_kv, c * bits / 8) uint8 packed; ``scale``/``zero``: (L, N, H_kv,
    c / group_size) float16 (asymmetric per token, KV head and channel group);
    ``sentence_of``: (N,) the sentence each token belongs to. ``c`` = d, or with ``rank`` > 0
    the rank: the codes are then of ``(k - mean) @ basis``, the centred key's coordinates in
    the top-``rank`` principal directions of the keys (``basis``: (L, H_kv, d, rank), ``mean``:
    (L, H_kv, d) float32, fitted once per sequence on the keys of its first demotion, ``fit``),
    and ``q . k ~ q . mean + (q @ basis) . codes`` (Loki: Singhania et al., "Loki: Low-rank
    Keys for Efficient Sparse Attention", NeurIPS 2024, §3-4: keys lie close to a
    low-dimensional subspace, so attention scores computed in the top principal components
    rank the keys nearly as the full dot products do). The score then reads rank/d of the
    codes, and a sketch token costs ``rank * (bits + 32 / group_size) / (64 d)`` of a token's
    fp32 K/V.
    """

    def __init__(self, bits: int, group_size: int, rank: int = 0, whiten: bool = False) -> None:
        self.bits, self.group_size, self.rank, self.whiten = bits, group_size, rank, whiten
        self.basis: torch.Tensor | None = None
        self.mean: torch.Tensor | None = None
        self.spread: torch.Tensor | None = None  # (L, H_kv, rank) with ``whiten``
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.sentence_of = torch.zeros(0, dtype=torch.long)
        self._last: tuple[torch.Tensor, tuple[int, float, int], torch.Tensor] | None = None
        self._hold = False  # ``held``: keep a layer's unpacked codes for the next call
        self._held: tuple[tuple[int, bool], torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within the block, ``head_logits`` keeps the last layer's unpacked codes (or its
        dequantized keys) and reuses them while the codes are unchanged: a prompt step's spans
        (``cache_node.query_spans``) score one layer one after the other, each on the same
        codes. The same tensors, so the same scores; dropped at the block's end (one layer's
        (H_kv, N, c) float32 transient, which a call makes anyway)."""
        self._hold = True
        try:
            yield
        finally:
            self._hold, self._held = False, None

    def fit(self, keys: torch.Tensor) -> None:
        """Fit the low-rank basis (``rank`` > 0) on keys (L, n, H_kv, d): per layer and KV head
        the mean and the top-``rank`` right singular vectors of the centred keys (a complete
        orthonormal basis is taken, so fewer than ``rank`` keys still give ``rank`` orthonormal
        directions). A no-op without a rank or once fitted.

        The directions are the eigenvectors of the (d, d) scatter matrix of the centred keys,
        largest eigenvalue first (the right singular vectors, without the (n, n) left factor a
        full SVD of an 8k-token demotion would materialise: 23 GB for SmolLM2's 30 layers)."""
        if not self.rank or self.basis is not None:
            return
        k = keys.float().permute(0, 2, 1, 3)  # (L, H_kv, n, d)
        self.rank = min(self.rank, k.shape[-1])  # a rank above the head dim keeps every direction
        self.mean = k.mean(2)
        centred = k - self.mean.unsqueeze(2)
        _, vecs = torch.linalg.eigh(centred.transpose(-1, -2) @ centred)  # (L, H_kv, d, d), ascending
        self.basis = vecs.flip(-1)[..., : self.rank].contiguous()  # (L, H_kv, d, rank)
        if self.whiten:  # each coordinate's standard deviation, floored at 1e-3 of the head's largest
            std = (centred @ self.basis).std(2, correction=0)  # (L, H_kv, rank)
            self.spread = std.clamp(min=1e-6).maximum(1e-3 * std.amax(-1, keepdim=True))

    def project(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys (L, n, H_kv, d) -> their sketched coordinates (L, n, H_kv, c) (``c`` = d without
        a rank; ``fit`` on these keys first when there is no basis yet)."""
        if not self.rank:
            return keys.float()
        self.fit(keys)
        assert self.basis is not None and self.mean is not None
        coords = torch.einsum("lnhd,lhdr->lnhr", keys.float() - self.mean.unsqueeze(1), self.basis)
        return coords if self.spread is None else coords / self.spread.unsqueeze(1)

    def append(self, keys: torch.Tensor, sentence: int) -> None:
        """Add one sentence's keys (L, n, H_kv, d)."""
        projected = self.project(keys)
        codes, scale, zero = quantize(projected, self.bits, channel_group(self.group_size, projected.shape[-1]))
        parts = (pack_bits(codes, self.bits), scale, zero)
        if self.codes is None:
            self.codes, self.scale, self.zero = parts
        else:
            self.codes, self.scale, self.zero = (
                torch.cat([old, new], 1) for old, new in zip((self.codes, self.scale, self.zero), parts)
            )
        new = torch.full((keys.shape[1],), sentence, device=keys.device)
        self.sentence_of = torch.cat([self.sentence_of.to(keys.device), new])

    def fork(self) -> KeySketch:
        """A copy sharing the (never mutated in place) tensors."""
        out = KeySketch(self.bits, self.group_size, self.rank, self.whiten)
        out.basis, out.mean, out.spread = self.basis, self.mean, self.spread
        out.codes, out.scale, out.zero, out.sentence_of = self.codes, self.scale, self.zero, self.sentence_of
        return out

    @property
    def nbytes(self) -> int:
        if self.codes is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero, self.basis, self.mean,
                                                         self.spread) if t is not None)

    def logits(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """(n, H_kv, g, N) ``scaling * q . k`` of every sketched token (a view of
        ``head_logits``). ``q``: (n, H, d)."""
        return self.head_logits(layer, q, scaling).permute(1, 0, 2, 3)

    def head_logits(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """(H_kv, n, g, N) ``scaling * q . k`` of every sketched token, on the codes: ``q . k =
        sum_G s_G (q_G . c_G) + z_G sum(q_G)``, never a dequantized key tensor; one batched
        matmul over the KV heads, ``(H_kv, n g, c) @ (H_kv, c, N)``, tokens last (the sentence
        sums in ``log_mass`` run along the last dim). ``q``: (n, H, d). With several channel
        groups and at least ``quant.SPAN_DEQUANT_MIN_ROWS`` query rows (a prompt's span: not a
        decode step's one query) the codes are dequantized into an (H_kv, N, c) float32 buffer
        instead, kept for the layer's next spans within ``held``.

        The last result is kept (with ``q`` itself, so the same query tensor is recognised and
        no other can take its address): the recall's scores (``log_mass``) and the recall
        bound (``bound.sketch_logits``) of one layer and step share one pass over the codes.
        """
        assert self.codes is not None and self.scale is not None and self.zero is not None
        key = (layer, scaling, self.codes.shape[1])
        if self._last is not None and self._last[0] is q and self._last[1] == key:
            return self._last[2]
        n, h, d = q.shape
        packed = self.codes[layer].permute(1, 0, 2)  # (H_kv, N, c * bits / 8)
        h_kv, num = packed.shape[:2]
        g = h // h_kv
        qf = q.float().view(n, h_kv, g, d).transpose(0, 1).reshape(h_kv, n * g, d) * scaling
        offset = None
        if self.rank:
            assert self.basis is not None and self.mean is not None
            offset = torch.bmm(qf, self.mean[layer].unsqueeze(-1))  # (H_kv, n g, 1): q . mean
            qf = torch.bmm(qf, self.basis[layer])  # (H_kv, n g, rank)
            if self.spread is not None:  # q . (k - mean) ~ (q @ basis * spread) . whitened code
                qf = qf * self.spread[layer].unsqueeze(1)
        c = qf.shape[-1]
        groups = c // channel_group(self.group_size, c)
        if groups > 1 and n * g >= SPAN_DEQUANT_MIN_ROWS:  # a span or a long chunk: dequantize the codes once
            (keys,) = self._layer_codes(layer, packed, True)  # (H_kv, N, c)
            logits = torch.bmm(qf, keys.transpose(1, 2))  # (H_kv, n g, N)
        else:
            codes, scale, zero = self._layer_codes(layer, packed, False)  # (H_kv, N, c), (H_kv, G, N) x2
            qsum = qf.view(h_kv, n * g, groups, -1).sum(-1)  # (H_kv, n g, G)
            if groups == 1:
                logits = torch.bmm(qf, codes.transpose(1, 2)).mul_(scale)  # (H_kv, n g, N)
            else:
                dots = torch.einsum("hkGs,hNGs->hkGN", qf.view(h_kv, n * g, groups, -1),
                                    codes.view(h_kv, num, groups, -1))
                logits = (dots * scale.unsqueeze(1)).sum(2)
            logits = logits.add_(torch.bmm(qsum, zero))
        if offset is not None:
            logits = logits.add_(offset)
        logits = logits.view(h_kv, n, g, num)
        self._last = (q, key, logits)
        return logits

    def _layer_codes(self, layer: int, packed: torch.Tensor, dequant: bool) -> tuple[torch.Tensor, ...]:
        """``head_logits``' operands for ``layer`` (``packed``: its codes (H_kv, N, c bits / 8)):
        the dequantized keys (H_kv, N, c), or the unpacked codes (H_kv, N, c) with the scales
        and zeros (H_kv, G, N) float32; kept within ``held`` while the codes are the same."""
        assert self.scale is not None and self.zero is not None
        key = (layer, dequant)
        if self._held is not None and self._held[0] == key and self._held[1] is self.codes:
            return self._held[2]
        if dequant:
            parts: tuple[torch.Tensor, ...] = (dequantize(packed, self.scale[layer].permute(1, 0, 2).float(),
                                                          self.zero[layer].permute(1, 0, 2).float(), self.bits),)
        else:
            parts = (unpack_bits_float(packed, self.bits), self.scale[layer].permute(1, 2, 0).float(),
                     self.zero[layer].permute(1, 2, 0).float())
        if self._hold:
            assert self.codes is not None
            self._held = (key, self.codes, parts)
        return parts

    def log_mass(self, layer: int, q: torch.Tensor, scaling: float, num_sentences: int) -> torch.Tensor:
        """(n, H_kv, g, S) ``logsumexp`` over each sentence's tokens of ``scaling * q . k``
        (``head_logits``). ``q``: (n, H, d)."""
        logits = self.head_logits(layer, q, scaling)  # (H_kv, n, g, N)
        top = logits.amax(-1, keepdim=True)
        mass = logits.new_zeros((*logits.shape[:3], num_sentences))
        mass.index_add_(-1, self.sentence_of, (logits - top).exp_())
        return (mass.log_() + top).transpose(0, 1)

    def part(self, layer: int) -> tuple[KeySketch, int]:
        """The sketch holding ``layer``'s codes and the layer's index in it (itself here;
        ``LayeredSketch`` splits the layers)."""
        return self, layer


class LayeredSketch:
    """Key sketches of different precision for consecutive runs of layers: ``parts[i]`` =
    (first layer, ``KeySketch``) covers layers ``first_i .. first_{i+1} - 1``. Layers differ in
    how sharply a decode query picks among the demoted sentences (SpindleKV's layer-aware
    budgets; PyramidKV §3), so a run of layers that reselects every step can take finer codes
    (``SentenceKV.deep_sketch_bits``) while the rest keep the cheaper ones. Same interface as
    ``KeySketch``: keys (L, n, H_kv, d) are split by layer, a layer's scores come from its part.

    Raises:
        ValueError: the first part does not start at layer 0, or the starts do not increase.
    """

    def __init__(self, parts: list[tuple[int, KeySketch]]) -> None:
        starts = [first for first, _ in parts]
        if not parts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError(f"parts must start at layer 0 with increasing first layers, got {starts}")
        self.parts = parts

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """``KeySketch.held`` for every part."""
        with contextlib.ExitStack() as stack:
            for _, sketch in self.parts:
                stack.enter_context(sketch.held())
            yield

    def part(self, layer: int) -> tuple[KeySketch, int]:
        """The part holding ``layer`` and the layer's index in it."""
        for first, sketch in reversed(self.parts):
            if layer >= first:
                return sketch, layer - first
        raise IndexError(layer)

    def _split(self, keys: torch.Tensor) -> list[tuple[KeySketch, torch.Tensor]]:
        ends = [first for first, _ in self.parts[1:]] + [keys.shape[0]]
        return [(sketch, keys[first:end]) for (first, sketch), end in zip(self.parts, ends)]

    @property
    def rank(self) -> int:
        return self.parts[0][1].rank

    @property
    def basis(self) -> torch.Tensor | None:
        return self.parts[0][1].basis

    def fit(self, keys: torch.Tensor) -> None:
        for sketch, part_keys in self._split(keys):
            sketch.fit(part_keys)

    def append(self, keys: torch.Tensor, sentence: int) -> None:
        for sketch, part_keys in self._split(keys):
            sketch.append(part_keys, sentence)

    def fork(self) -> LayeredSketch:
        return LayeredSketch([(first, sketch.fork()) for first, sketch in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(sketch.nbytes for _, sketch in self.parts)

    def logits(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        sketch, local = self.part(layer)
        return sketch.logits(local, q, scaling)

    def log_mass(self, layer: int, q: torch.Tensor, scaling: float, num_sentences: int) -> torch.Tensor:
        sketch, local = self.part(layer)
        return sketch.log_mass(local, q, scaling, num_sentences)
