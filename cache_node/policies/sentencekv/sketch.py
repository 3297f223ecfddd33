"""SentenceKV's key sketch: low-bit codes of every demoted token's key, scored on the codes
(HACK §4) to rank sentences on the device tier."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cache_node.policies.quant import pack_bits, quantize, unpack_bits


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
        self._table: torch.Tensor | None = None
        self._last: tuple[torch.Tensor, tuple[int, float, int], torch.Tensor] | None = None

    def decode_table(self, device: torch.device) -> torch.Tensor:
        """(256, 8 / bits) float32: the codes packed in each byte value (``unpack_bits`` of
        0..255), so decoding the codes is one table lookup per byte instead of a shift, a mask
        and a float conversion per code."""
        if self._table is None or self._table.device != device:
            self._table = unpack_bits(torch.arange(256, dtype=torch.uint8, device=device).unsqueeze(-1),
                                      self.bits).float()
        return self._table

    def decode(self, layer: int) -> torch.Tensor:
        """(N, H_kv, d) float32 codes of ``layer`` (equal to ``unpack_bits(...).float()``)."""
        assert self.codes is not None
        packed = self.codes[layer]  # (N, H_kv, d * bits / 8)
        return F.embedding(packed.int(), self.decode_table(packed.device)).flatten(-2)

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
        new = torch.full((keys.shape[1],), sentence, device=keys.device)
        self.sentence_of = torch.cat([self.sentence_of.to(keys.device), new])

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

    def logits(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """(n, H_kv, g, N) ``scaling * q . k`` of every sketched token, on the codes: ``q . k =
        sum_g s_g (q_g . c_g) + z_g sum(q_g)``, never a dequantized key tensor. ``q``: (n, H, d).

        The last result is kept (with ``q`` itself, so the same query tensor is recognised and
        no other can take its address): the recall's scores (``log_mass``) and the recall
        bound (``bound.sketch_logits``) of one layer and step share one pass over the codes.
        """
        assert self.codes is not None and self.scale is not None and self.zero is not None
        key = (layer, scaling, self.codes.shape[1])
        if self._last is not None and self._last[0] is q and self._last[1] == key:
            return self._last[2]
        n, h, d = q.shape
        codes = self.decode(layer)  # (N, H_kv, d)
        h_kv = codes.shape[1]
        qg = q.float().view(n, h_kv, h // h_kv, d // self.group_size, self.group_size)
        dots = torch.einsum("nhqGs,NhGs->nhqNG", qg, codes.view(*codes.shape[:2], -1, self.group_size))
        logits = (dots * self.scale[layer].float().permute(1, 0, 2).unsqueeze(0).unsqueeze(2)).sum(-1)
        logits = logits + torch.einsum("nhqG,NhG->nhqN", qg.sum(-1), self.zero[layer].float())
        logits = logits * scaling
        self._last = (q, key, logits)
        return logits

    def log_mass(self, layer: int, q: torch.Tensor, scaling: float, num_sentences: int) -> torch.Tensor:
        """(n, H_kv, g, S) ``logsumexp`` over each sentence's tokens of ``scaling * q . k``
        (``logits``). ``q``: (n, H, d)."""
        logits = self.logits(layer, q, scaling)
        top = logits.amax(-1, keepdim=True)
        mass = logits.new_zeros((*logits.shape[:3], num_sentences))
        mass.index_add_(-1, self.sentence_of, (logits - top).exp())
        return mass.log() + top
