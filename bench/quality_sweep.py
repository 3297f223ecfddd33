"""Demotion-threshold sweep of the attention-score policies: recall latency against perplexity.

For each policy (h2o, gkv, spindlekv) and threshold tau, every layer of a prefilled context
demotes the tokens whose score, divided by the layer's largest score among unprotected tokens,
falls below tau (sinks and the recent window stay); demoted K/V are copied to host memory.
Then:

- perplexity of held-out text is measured on the device-tier KV alone (what decoding sees
  until a recall), and
- recall latency is the wall time to promote every demoted token back: copy the host K/V into
  the sequence's blocks and re-lay the layer in position order (``SequenceKV.set_layout``).

SpindleKV's shallow-layer merging is not applied here (a threshold decides keep/demote only).
Source: kvstrata's own evaluation of the KV policies (docs/architecture.md, 'KV policies') /
issue 5 ("a sweep of the demotion threshold
(0.01-0.05) plotting recall latency against perplexity").
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from bench.quality_probe import Probe
from cache_node.compaction import gather_kv
from cache_node.policies import LayerPlan, make_policy

POLICIES = ("h2o", "gkv", "spindlekv")
THRESHOLDS = (0.01, 0.02, 0.03, 0.04, 0.05)


def threshold_plans(seq: Any, tau: float) -> list[LayerPlan]:
    """Per layer: keep protected tokens and those scoring >= tau x the top unprotected score."""
    kv, plans = seq.kv, []
    for layer in range(kv.pool.num_layers):
        view = kv.view(layer)
        score = kv.policy.score(view).float()
        protected = kv.policy.protected(view)
        top = score[~protected].max() if bool((~protected).any()) else score.max()
        keep = protected | (score >= tau * top.clamp(min=1e-12))
        plans.append(LayerPlan(keep.nonzero().squeeze(1)))
    return plans


def demote(seq: Any, plans: list[LayerPlan]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy each layer's demoted K/V to host memory and compact the kept ones on the device.
    Returns per layer (host K/V (n, 2, H_kv, d), their positions)."""
    kv = seq.kv
    host, host_pos = [], []
    for layer, plan in enumerate(plans):
        valid = (kv.positions[layer] >= 0).nonzero().squeeze(1)
        drop = torch.ones(len(valid), dtype=torch.bool)
        drop[plan.keep] = False
        slots = valid[drop]
        src = slots.unsqueeze(0).expand(kv.pool.num_layers, -1)
        host.append(gather_kv(kv.pool, seq, src)[layer].to("cpu", copy=True))
        host_pos.append(kv.positions[layer, slots].clone())
    kv.apply_plans(plans)
    kv.budget = max(kv.kept_counts()) + 256  # no further eviction while measuring
    return host, host_pos


def recall_all(seq: Any, host: list[torch.Tensor], host_pos: list[torch.Tensor]) -> float:
    """Promote every demoted token back (position order per layer); returns seconds."""
    t0 = time.perf_counter()
    kv = seq.kv
    L = kv.pool.num_layers
    n = max(kv.frontier + len(p) for p in host_pos)
    slots = torch.arange(kv.frontier).unsqueeze(0).expand(L, -1)
    kept = gather_kv(kv.pool, seq, slots)
    data = torch.zeros((L, n, *kept.shape[2:]), dtype=kept.dtype)
    positions = torch.full((L, n), -1, dtype=torch.long)
    for layer in range(L):
        pos = torch.cat([kv.positions[layer], host_pos[layer]])
        rows = torch.cat([kept[layer], host[layer].to(kept.dtype)])
        order = pos.argsort()
        order = order[pos[order] >= 0]
        data[layer, : len(order)], positions[layer, : len(order)] = rows[order], pos[order]
    kv.set_layout(data, positions, (positions >= 0).float())
    return time.perf_counter() - t0


def sweep(probe: Probe, base: Any, held: list[int], full_bytes: int,
          policies: tuple[str, ...] = POLICIES, thresholds: tuple[float, ...] = THRESHOLDS) -> list[dict]:
    """One row per (policy, tau): kept bytes ratio, perplexity on the device tier, recall ms."""
    targets = torch.tensor(held[1:])
    rows = []
    for name in policies:
        for tau in thresholds:
            seq = probe.fork(base, make_policy(name))
            seq.kv.budget = seq.kv.policy.budget_tokens(seq.num_prompt_tokens)
            host, host_pos = demote(seq, threshold_plans(seq, tau))
            ratio = seq.kv.device_bytes() / full_bytes  # blocks follow the layer that keeps most
            kept = sum(seq.kv.kept_counts()) / len(host_pos) / seq.num_computed_tokens
            probe_seq = probe.fork(seq)
            logits = probe.teacher_force(probe_seq, held[:1], held[1:])
            probe.release(probe_seq)
            recall_s = recall_all(seq, host, host_pos)
            probe.release(seq)
            nll = float(torch.nn.functional.cross_entropy(logits[:-1], targets))
            rows.append({"policy": name, "threshold": tau, "device_bytes_ratio": ratio,
                         "kept_token_ratio": kept, "demoted_tokens": sum(len(p) for p in host_pos) / len(host_pos),
                         "ppl": math.exp(nll), "recall_ms": 1e3 * recall_s})
    return rows


def plot(rows: list[dict], ppl_full: float, path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["policy"] for r in rows):
        pts = [r for r in rows if r["policy"] == name]
        ax.plot([r["recall_ms"] for r in pts], [r["ppl"] for r in pts], marker="o", label=name)
        for r in pts:
            ax.annotate(f"{r['threshold']:g} ({r['kept_token_ratio']:.2f})", (r["recall_ms"], r["ppl"]),
                        fontsize=6, textcoords="offset points", xytext=(3, 3))
    ax.axhline(ppl_full, color="gray", ls="--", lw=1, label="full cache")
    ax.set(xlabel="recall latency, all demoted tokens back (ms)", ylabel="perplexity on the device tier",
           title="demotion threshold sweep: tau (kept tokens / full)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
