"""SentenceKV's overflow region (exact-recall mode, ``recall_eps``): the sentences one layer
recalls beyond its budgeted recall region in a step, as raw K/V per KV head, attended as extra
KV together with the region (``ChainedKV``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from cache_node.policies.sentencekv.host_kv import TierHostKV

if TYPE_CHECKING:
    from cache_node.policies.sentencekv.store import HostSentenceStore


class ExtraKVPart(Protocol):
    def logits(self, qh: torch.Tensor, scaling: float) -> torch.Tensor: ...
    def output(self, probs: torch.Tensor) -> torch.Tensor: ...
    def dense_kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class OverflowKV:
    """One layer's overflow: per KV head its own sentences' raw K/V read from the host (one
    read of the heads' union per layer), padded to the longest head's token count (padding
    masked out).

    ``k``/``v``: (H_kv, O, d) in the pool's dtype on ``device``; ``empty``: (H_kv, O) bool;
    ``sids[h]``: KV head ``h``'s sentences.
    """

    def __init__(self, store: HostSentenceStore, layer: int, sids: list[list[int]],
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.sids = sids
        union = sorted({s for heads in sids for s in heads})
        lengths = {s: len(store.positions[s]) for s in union}
        handles = [store.handles[s] for s in union]
        every: torch.Tensor | None = None
        if union and isinstance(store.host, TierHostKV):  # host-tier slots: one gather
            every = store.host.read(torch.cat(handles), layer)  # (T, 2, H_kv, d)
        elif union:
            every = torch.cat([store.sentence_kv(s, layer) for s in union])
        starts = dict(zip(union, [0, *torch.tensor([lengths[s] for s in union]).cumsum(0).tolist()]))
        counts = [sum(lengths[s] for s in heads) for heads in sids]
        width = max(counts, default=0)
        kv = torch.zeros((len(sids), width, 2, head_dim), dtype=dtype, device=device)
        self.empty = torch.ones((len(sids), width), dtype=torch.bool, device=device)
        for head, heads in enumerate(sids):
            if heads:
                assert every is not None
                idx = torch.cat([torch.arange(starts[s], starts[s] + lengths[s]) for s in heads])
                kv[head, : counts[head]] = every[idx, :, head].to(device=device, dtype=dtype)
                self.empty[head, : counts[head]] = False
        self.k, self.v = kv[:, :, 0], kv[:, :, 1]
        self.num_tokens = sum(counts)

    @property
    def nbytes(self) -> int:
        """Device bytes of the overflow's K/V (padding included)."""
        return 2 * self.k.numel() * self.k.element_size()

    def logits(self, qh: torch.Tensor, scaling: float) -> torch.Tensor:
        """(H_kv, g, n, O) for ``qh`` (H_kv, g, n, d); padding is -inf."""
        scores = qh @ self.k.to(qh.dtype).transpose(1, 2).unsqueeze(1) * scaling
        return scores.masked_fill(self.empty[:, None, None, :], float("-inf"))

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        return probs @ self.v.to(probs.dtype).unsqueeze(1)  # (H_kv, g, n, d)

    def dense_kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K and V (H_kv, O, d) in ``dtype`` and the padding (H_kv, O)."""
        return self.k.to(dtype), self.v.to(dtype), self.empty


class ChainedKV:
    """Extra KV made of parts attended side by side (the region, then the overflow): logits
    concatenated along the key axis, each part's output from its own columns of ``probs``."""

    def __init__(self, parts: list[ExtraKVPart]) -> None:
        self.parts = parts
        self.widths: list[int] = []

    def logits(self, qh: torch.Tensor, scaling: float) -> torch.Tensor:
        out = [p.logits(qh, scaling) for p in self.parts]
        self.widths = [x.shape[-1] for x in out]
        return torch.cat(out, -1)

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        outs = [p.output(c) for p, c in zip(self.parts, probs.split(self.widths, -1))]
        total = outs[0]
        for o in outs[1:]:
            total = total + o
        return total

    def dense_kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The parts' K, V and skipped slots (``DenseExtraKV.dense_kv``) side by side."""
        parts = [p.dense_kv(dtype) for p in self.parts]
        skip = [e if e is not None else torch.zeros(k.shape[:2], dtype=torch.bool, device=k.device)
                for k, _, e in parts]
        return torch.cat([k for k, _, _ in parts], 1), torch.cat([v for _, v, _ in parts], 1), torch.cat(skip, 1)
