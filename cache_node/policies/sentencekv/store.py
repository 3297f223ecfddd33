"""SentenceKV's per-sequence state: the sentences demoted to host RAM, their device-tier index
(key sketch or mean keys) and the recall region."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cache_node.policies.sentencekv.host_kv import PrivateHostKV, TierHostKV
from cache_node.policies.sentencekv.region import SentenceCodes
from cache_node.policies.sentencekv.sketch import KeySketch, LayeredSketch


@dataclass
class HostSentenceStore:
    """Sentences demoted to host RAM, their device-tier index, and the recall region.

    ``host``: where the sentences' raw K/V lives (the engine's host tier, or the sequence's own
    CPU tensors without one); ``handles[s]`` finds sentence ``s`` there. Index (device tier):
    ``sketch`` (key codes, ``select_mode="sketch"``) or ``mean_keys`` (S, L, H_kv * d) float32
    (the other modes). ``region_kv[l]``: (2, H_kv, R_l, d) layer ``l``'s promoted sentences'
    K/V on the pool's device, each KV head its own (``region_positions[l]`` (H_kv, R_l), -1 =
    empty slot); with ``region_bits`` 8 or 4 it holds codes (2, H_kv, R_l, d * bits / 8) uint8
    instead, with ``region_scale[l]``/``region_zero[l]`` (2, H_kv, R_l, d / group) float16, copied
    from ``codes`` (every demoted token's codes, quantized once at demotion, host RAM). ``R_l``
    is the same in every layer unless ``layer_share`` (L,) splits the slots among the layers
    (``SentenceKV.layer_budget``).
    ``dropped_tokens``: tokens demoted while the host tier was full (lost, as on eviction).
    """

    host: PrivateHostKV | TierHostKV = field(default_factory=PrivateHostKV)
    sketch: KeySketch | LayeredSketch | None = None
    positions: list[torch.Tensor] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    mean_keys: torch.Tensor | None = None
    region_kv: list[torch.Tensor] | None = None
    region_positions: list[torch.Tensor] | None = None
    region_scale: list[torch.Tensor] | None = None
    region_zero: list[torch.Tensor] | None = None
    codes: SentenceCodes | None = None
    resident: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)  # layer -> per head
    recall_s: float = 0.0
    num_recalls: int = 0
    dropped_tokens: int = 0
    layer_share: torch.Tensor | None = None
    region_version: dict[int, int] = field(default_factory=dict)  # layer -> its region's last edit
    _edits: int = 0
    _sid_of_pos: tuple[int, np.ndarray] | None = field(default=None, repr=False)
    _flat: tuple[list[int], list[int], np.ndarray, np.ndarray] | None = field(default=None, repr=False)

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

    def flat(self) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
        """The sentences laid end to end in demotion order (the order of ``codes`` along N):
        ``lengths[s]`` and ``first[s]`` (sentence ``s``'s first position) as lists, ``starts``
        (S,) the flat index of each sentence's first token and ``positions`` (N,) every
        token's position, as int64 arrays. Rebuilt only after a sentence was added."""
        if self._flat is None or len(self._flat[0]) != len(self.positions):
            lengths = [len(p) for p in self.positions]
            pos = torch.cat(self.positions).cpu().numpy() if self.positions else np.zeros(0, np.int64)
            starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64) if lengths else np.zeros(0, np.int64)
            self._flat = (lengths, pos[starts].tolist(), starts, pos)
        return self._flat

    def region_index(self, chosen: Sequence[Sequence[int]], heads: Sequence[int]
                     ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The tokens of the sentences ``chosen[h]`` of each KV head ``h`` in ``heads``, heads in
        the order given, each head's sentences in the order given: their flat indices (n,),
        each one's KV head (n,), and the number of tokens per head."""
        lengths, _, starts, _ = self.flat()
        runs = [np.arange(starts[s], starts[s] + lengths[s]) for h in heads for s in chosen[h]]
        counts = [sum(lengths[s] for s in chosen[h]) for h in heads]
        tok = np.concatenate(runs) if runs else np.zeros(0, np.int64)
        return tok, np.repeat(np.asarray(heads, np.int64), counts), counts

    def load_region(self, layer: int, chosen: Sequence[Sequence[int]], heads: Sequence[int],
                    before: Sequence[Sequence[int]] | None = None) -> None:
        """Fill KV heads ``heads`` of ``layer``'s region with their sentences ``chosen[h]``: the
        codes made at demotion (``codes``) or the raw K/V read from the host. Without
        ``before`` each head is refilled token after token from slot 0, the rest of its slots
        marked empty; with ``before`` (the sentences the heads hold now) only the sentences
        new to a head are copied, into the slots of the ones it drops and its empty slots
        (attention reads a head's slots as a set: their order does not matter). One gather
        from host RAM for all ``heads``, then one scatter per region tensor.

        The slots are planned on the host (numpy, on a copy of the layer's (H_kv, R) slot
        positions: which slots each head frees, which empty slots each new token takes, each
        head's first ones in row-major order) and reach the device as one index of the slots
        that change and their new positions, so a call is a fixed handful of device ops
        whatever the number of sentences moved."""
        assert self.region_kv is not None and self.region_positions is not None
        self._edited([layer])
        pos = self.region_positions[layer]  # (H_kv, R)
        dev = pos.device
        heads = sorted(heads)  # the gathered tokens go head after head, as the slots are taken
        old = pos.cpu().numpy()
        slots = old.copy()  # (H_kv, R) the plan
        if before is None:
            slots[heads] = -1
            adds: Sequence[Sequence[int]] = chosen
        else:
            adds = [()] * len(chosen)
            sid = self._sentence_of_position()
            for h in heads:
                new, held = set(chosen[h]), set(before[h])
                adds[h] = [s for s in chosen[h] if s not in held]
                gone = [s for s in before[h] if s not in new]
                if gone:  # free the slots of the sentences the head gives up
                    row = slots[h]
                    is_gone = np.zeros(len(self.positions) + 1, bool)  # index -1 (empty slot): False
                    is_gone[gone] = True
                    row[is_gone[sid[row.clip(0)]] & (row >= 0)] = -1
        tok, head_idx, counts = self.region_index(adds, heads)
        want = np.zeros(slots.shape[0], np.int64)
        want[heads] = counts
        free = slots < 0  # each head's first counts[h] empty slots, row-major: the gathered tokens' order
        taken = np.flatnonzero(free & (free.cumsum(1) <= want[:, None]))
        flat = slots.reshape(-1)
        flat[taken] = self.flat()[3][tok]
        moved = np.flatnonzero(flat != old.reshape(-1))
        if len(moved):
            pos.view(-1).index_copy_(0, torch.from_numpy(moved).to(dev), torch.from_numpy(flat[moved]).to(dev))
        if not len(tok):
            return
        taken_t = torch.from_numpy(taken).to(dev)
        if self.codes is not None:
            assert self.region_scale is not None and self.region_zero is not None and self.codes.codes is not None
            rows = torch.from_numpy(head_idx * self.codes.codes.shape[2] + tok)
            dsts = (self.region_kv, self.region_scale, self.region_zero)
            srcs = [t.to(dev) for t in self.codes.gather(rows, layer)]  # (n, 2, ...) each
        else:
            dsts = (self.region_kv,)
            srcs = [self._raw_kv(layer, adds, heads, torch.from_numpy(tok), torch.from_numpy(head_idx))
                    .to(self.region_kv[layer])]
        for dst, src in zip(dsts, srcs):  # (2, H_kv, R, w) each: slot h * R + r
            d, x = _as_words(dst[layer]), _as_words(src)  # rows of bytes copied 8 at a time
            d.view(2, -1, d.shape[-1]).index_copy_(1, taken_t, x.transpose(0, 1))

    def _raw_kv(self, layer: int, chosen: Sequence[Sequence[int]], heads: Sequence[int],
                tok: torch.Tensor, head_idx: torch.Tensor) -> torch.Tensor:
        """(n, 2, d) raw K/V of the flat tokens ``tok``, each in its KV head ``head_idx``."""
        if isinstance(self.host, TierHostKV):
            return self.host.read_heads(torch.cat(self.handles)[tok], layer, head_idx)
        return torch.cat([self.sentence_kv(s, layer, h) for h in heads for s in chosen[h]])

    def sentence_kv(self, sid: int, layer: int, head: int | None = None) -> torch.Tensor:
        """(n, 2, H_kv, d) raw K/V of sentence ``sid`` in ``layer``, read from the host."""
        return self.host.read(self.handles[sid], layer, head)

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def index_nbytes(self) -> int:
        """Device-tier bytes of the sentence index (sketch or mean keys), plus the region codes'
        per-channel key scales (``SentenceCodes.key_scale``)."""
        extra = 0 if self.codes is None else self.codes.key_scale_nbytes
        if self.sketch is not None:
            return self.sketch.nbytes + extra
        return extra + (0 if self.mean_keys is None else self.mean_keys.numel() * self.mean_keys.element_size())

    @property
    def region_tokens(self) -> int:
        """R: the region's slots per KV head, averaged over the layers (rounded down; every
        layer's without ``layer_share``)."""
        if self.region_positions is None:
            return 0
        return sum(p.shape[-1] for p in self.region_positions) // len(self.region_positions)

    def region_slots(self, layer: int) -> int:
        """R_l: layer ``layer``'s region slots per KV head."""
        return 0 if self.region_positions is None else self.region_positions[layer].shape[-1]

    @property
    def region_nbytes(self) -> int:
        """Device bytes of the region (codes and scales included; every slot, filled or not)."""
        parts = (self.region_kv, self.region_scale, self.region_zero)
        return sum(t.numel() * t.element_size() for ts in parts if ts is not None for t in ts)

    def resize_region(self, sizes: Sequence[int], like: torch.Tensor, bits: int = 0, group_size: int = 16) -> None:
        """An empty region of ``sizes[l]`` slots per KV head in layer ``l``; ``like``: (L, 2,
        S, H_kv, d) the pool tensor (dtype, device, shape); ``bits`` 0 keeps the pool's dtype,
        8 or 4 holds codes with per-``group_size`` scales."""
        _, _, _, h_kv, d = like.shape
        dev = like.device
        self.region_positions = [torch.full((h_kv, r), -1, dtype=torch.long, device=dev) for r in sizes]
        self.region_scale = self.region_zero = None
        if bits:
            self.region_kv = [torch.zeros((2, h_kv, r, d * bits // 8), dtype=torch.uint8, device=dev) for r in sizes]
            self.region_scale = [torch.zeros((2, h_kv, r, d // group_size), dtype=torch.float16, device=dev)
                                 for r in sizes]
            self.region_zero = [torch.zeros_like(t) for t in self.region_scale]
        else:
            self.region_kv = [torch.zeros((2, h_kv, r, d), dtype=like.dtype, device=dev) for r in sizes]
        self.resident.clear()
        self._edited(range(len(sizes)))

    def fit_region(self, sizes: Sequence[int]) -> None:
        """Resize layer ``l``'s region to ``sizes[l]`` slots per KV head, keeping what it holds
        (a compaction during decoding changes the slots by a few as the index grows): a layer
        that grows gets empty slots at the end; one that shrinks first gives up, per KV head,
        every sentence with a token in a slot past the new size (``resident`` forgets it), then
        moves the head's remaining tokens to its first slots (attention reads a head's slots as
        a set). No copy from the host; the next selection fills the free slots."""
        assert self.region_kv is not None and self.region_positions is not None
        changed = []
        for layer, r in enumerate(sizes):
            pos = self.region_positions[layer]  # (H_kv, R)
            old = pos.shape[1]
            if r == old:
                continue
            changed.append(layer)
            parts = [ts for ts in (self.region_kv, self.region_scale, self.region_zero) if ts is not None]
            if r > old:
                self.region_positions[layer] = torch.cat([pos, pos.new_full((pos.shape[0], r - old), -1)], 1)
                for ts in parts:  # (2, H_kv, R, w) each
                    t = ts[layer]
                    ts[layer] = torch.cat([t, t.new_zeros(*t.shape[:2], r - old, t.shape[3])], 2)
                continue
            sids = self.slot_sentences(layer)
            tail = sids[:, r:]
            drop = (sids.unsqueeze(-1) == tail.unsqueeze(1)).any(-1) & (sids >= 0)  # (H_kv, R)
            resident = self.resident.get(layer)
            if resident is not None:
                gone = [set(row.tolist()) - {-1} for row in tail]
                self.resident[layer] = tuple(tuple(s for s in sids_h if s not in gone[h])
                                             for h, sids_h in enumerate(resident))
            pos = pos.masked_fill(drop, -1)
            order = (pos < 0).to(torch.int8).sort(dim=1, stable=True).indices[:, :r]  # filled slots first
            self.region_positions[layer] = pos.gather(1, order)
            for ts in parts:
                t = ts[layer]
                ts[layer] = t.gather(2, order[None, :, :, None].expand(t.shape[0], -1, -1, t.shape[3]))
        self._edited(changed)

    def _edited(self, layers: Sequence[int]) -> None:
        """Mark ``layers``' regions changed (what caches of a region's slots key on)."""
        self._edits += 1
        for layer in layers:
            self.region_version[layer] = self._edits

    def _sentence_of_position(self) -> np.ndarray:
        """(max position + 1,) int64: the sentence holding each demoted position, -1 where
        none does (rebuilt only after a sentence was added)."""
        if self._sid_of_pos is None or self._sid_of_pos[0] != len(self.positions):
            lengths, _, _, flat_pos = self.flat()
            table = np.full(int(flat_pos.max()) + 1 if len(flat_pos) else 1, -1, np.int64)
            table[flat_pos] = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
            self._sid_of_pos = (len(self.positions), table)
        return self._sid_of_pos[1]

    def slot_sentences(self, layer: int) -> torch.Tensor:
        """(H_kv, R_l) the id of the sentence whose token each of ``layer``'s region slots holds,
        -1 where a slot is empty. A head's slots hold its sentences in no set order
        (``load_region`` reuses the slots of the sentences it drops), so anything kept per slot
        is looked up through this, never through the order of ``resident``."""
        assert self.region_positions is not None
        pos = self.region_positions[layer]
        table = torch.from_numpy(self._sentence_of_position()).to(pos.device)
        return table[pos.clamp(min=0, max=len(table) - 1)].masked_fill(pos < 0, -1)

    def fork(self) -> HostSentenceStore:
        """An independent copy (host K/V, index and region copied or shared immutably)."""
        sketch = None if self.sketch is None else self.sketch.fork()
        region, region_pos, scale, zero = (
            None if ts is None else [t.clone() for t in ts]
            for ts in (self.region_kv, self.region_positions, self.region_scale, self.region_zero)
        )
        codes = None if self.codes is None else self.codes.fork()
        return HostSentenceStore(self.host.fork(), sketch, list(self.positions), list(self.handles),
                                 self.mean_keys, region, region_pos, scale, zero, codes, dict(self.resident),
                                 self.recall_s, self.num_recalls, self.dropped_tokens, self.layer_share,
                                 dict(self.region_version), self._edits)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dim's bytes viewed as int64 words where they divide evenly (uint8
    codes: a row scatter then moves 8 bytes per element, ~2x faster), else ``t``."""
    if t.dtype == torch.uint8 and t.shape[-1] % 8 == 0 and t.stride(-1) == 1 and t.storage_offset() % 8 == 0:
        return t.view(torch.int64)
    return t
