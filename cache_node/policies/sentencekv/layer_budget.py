"""SentenceKV's layer-wise split of the recall region (``SentenceKV.layer_budget="mass"``).

Layers differ in how much of a query's attention falls on the demoted tokens and how widely it
spreads over them: on SmolLM2-135M the first layer's last query puts ~3/4 of its mass on a 4k
document and needs ~1,000 of its tokens for 90% of that, while middle layers put under a tenth
there. A region of equal size per layer starves the first and wastes slots in the others.
PyramidKV (Cai et al., 2024, §3) and SpindleKV (layer-aware budgets) give layers different KV
budgets; here the split is measured, once per sequence, from the window queries the
compression keeps (SnapKV's observation window): the region's slots go to the demoted tokens
with the largest mean attention over all layers and KV heads (a global score across layers, as
G-KV ranks tokens), each layer keeping at least ``floor`` of an equal share, since the window
queries do not show what a later question retrieves.
"""

from __future__ import annotations

import torch


def layer_shares(queries: list[torch.Tensor | None], query_pos: list[torch.Tensor | None],
                 demoted_keys: torch.Tensor, demoted_pos: torch.Tensor, kept_keys: torch.Tensor,
                 kept_pos: torch.Tensor, scaling: float, region_slots: int, floor: float = 0.5) -> torch.Tensor:
    """(L,) each layer's share of the region's slots (summing to 1).

    Args:
        queries: per layer the window queries (w, H, d) (None: the layer gets an equal share).
        query_pos: per layer their positions (w,).
        demoted_keys: (L, n, H_kv, d) the keys about to be demoted, at ``demoted_pos`` (n,).
        kept_keys: (L, m, H_kv, d) the keys kept in the pool (sinks, window), at ``kept_pos`` (m,).
        scaling: the attention's logit scale (``head_dim ** -0.5``).
        region_slots: R, the region's slots per layer and KV head were they split equally.
        floor: the least share of a layer, as a fraction of ``1 / L``.

    Every demoted token gets, per layer and KV head, its attention from the window queries
    (causal softmax over demoted and kept keys, averaged over the queries and the KV head's
    query heads). The ``L * H_kv * R`` largest of these over all layers are the tokens a region
    of that many slots would hold to catch the most attention; the share of each layer is the
    fraction of them it holds, raised to the floor.
    """
    num_layers, n, h_kv, _ = demoted_keys.shape
    equal = torch.full((num_layers,), 1.0 / num_layers)
    if n == 0:
        return equal
    masses = []
    for layer in range(num_layers):
        q, qp = queries[layer], query_pos[layer]
        if q is None or qp is None:
            masses.append(None)
            continue
        w, h, d = q.shape
        qg = q.float().view(w, h_kv, h // h_kv, d)
        keys = torch.cat([demoted_keys[layer], kept_keys[layer]]).float()  # (n + m, H_kv, d)
        pos = torch.cat([demoted_pos, kept_pos]).to(qp.device)
        logits = torch.einsum("whgd,thd->whgt", qg, keys.to(qg.device)) * scaling
        logits = logits.masked_fill((pos[None, :] > qp[:, None])[:, None, None, :], float("-inf"))
        probs = logits.softmax(-1)[..., :n]  # (w, H_kv, g, n): the demoted tokens' part
        masses.append(probs.mean((0, 2)).flatten())  # (H_kv * n,)
    known = [m for m in masses if m is not None]
    if not known:
        return equal
    flat = torch.cat(known)
    k = min(len(flat), max(1, num_layers * h_kv * region_slots))
    top = flat.topk(k).values[-1]
    counts = torch.tensor([k / num_layers if m is None else float((m >= top).sum()) for m in masses])
    shares = counts / counts.sum()
    lo = floor / num_layers
    # raise every layer to the floor, taking the slots from the layers above it in proportion
    low = shares < lo
    if low.any():
        spare = (shares - lo).clamp(min=0)
        need = float((lo - shares[low]).sum())
        shares = torch.where(low, torch.full_like(shares, lo), shares - spare / spare.sum() * need)
    return shares / shares.sum()


def split_slots(total: int, shares: torch.Tensor) -> list[int]:
    """``total`` slots split by ``shares`` (L,) into whole slots per layer, summing to at most
    ``total`` (rounded down, the remainder to the largest fractions)."""
    exact = shares.double() * total
    sizes = exact.floor().long()
    rest = total - int(sizes.sum())
    if rest > 0:
        sizes[(exact - sizes).argsort(descending=True)[:rest]] += 1
    return sizes.tolist()
