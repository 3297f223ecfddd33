"""Quality of every KV policy against the full cache, on real Wikipedia text.

    python -m bench.quality [--quick] [--out reports/quality]

Per context (Wikipedia summaries concatenated to a target length, a pass key and a secret word
inserted at a depth): prefill once, compress once per policy and device budget (50/25/12.5% of
the full cache's bytes), then ask several questions of the same compressed context. Metrics:
passkey/needle accuracy (only items the full cache answers count), KL(full || policy) of the
next-token distributions and greedy agreement along the full cache's answer (teacher forced),
perplexity of held-out continuation text, and the device bytes the policy holds / full.
Writes ``results.json``, ``quality.md``, ``quality.png``, ``memory_vs_position.png`` under
``--out``; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.quality_probe import Probe
from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import load_model
from cache_node.policies import PolicyEnv
from cache_node.sampling_params import SamplingParams
from workloads.corpus import load_corpus

BUDGETS = (0.5, 0.25, 0.125)
EVICTING = ("streaming", "h2o", "snapkv", "gkv", "spindlekv", "sentencekv")
QUANT = ("quant-bits_8", "quant-bits_4")
WORDS = ("pineapple", "lighthouse", "saxophone", "glacier", "cinnamon", "volcano", "harbor", "meadow")


def build_items(tok: Any, lengths: list[int], depths: list[float], seed: int = 0) -> list[dict]:
    """Contexts of ``lengths`` tokens with two needles at each depth, plus held-out text."""
    rng = random.Random(seed)
    articles = [a for a in load_corpus() if len(a.extract) > 400]
    items = []
    for length in lengths:
        for depth in depths:
            rng.shuffle(articles)
            text, i = "", 0
            while len(tok.encode(text)) < length + 64:
                text += articles[i].extract.strip() + "\n\n"
                i += 1
            key, word = f"{rng.randint(10000, 99999)}", rng.choice(WORDS)
            needle = f" The pass key is {key}. Remember it. The secret word is {word}. "
            sents = text.split(". ")
            cut = max(1, int(depth * len(sents)))
            body = ". ".join(sents[:cut]) + "." + needle + ". ".join(sents[cut:])
            ids = tok.encode(body)[:length]
            held = tok.encode(articles[i].extract.strip())[:24]
            items.append({
                "length": length, "depth": depth, "context": ids, "held": held,
                "questions": [
                    ("passkey", tok.encode("\n\nWhat is the pass key mentioned above? The pass key is"), key),
                    ("word", tok.encode("\n\nWhat is the secret word mentioned above? The secret word is"), word),
                ],
            })
    return items


def kl_and_agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return float(kl.mean()), float((ref.argmax(-1) == got.argmax(-1)).float().mean())


def evaluate_item(probe: Probe, tok: Any, item: dict, specs: list[str], rows: dict) -> None:
    base, _ = probe.prefill(item["context"])
    full_bytes = len(base.block_table) * probe.pool.bytes_per_block
    stop = {tok.encode("\n")[0], tok.eos_token_id}
    refs = []
    for kind, q, answer in item["questions"]:
        seq = probe.fork(base)
        gen = probe.greedy(seq, q, 8, stop)
        probe.release(seq)
        text = tok.decode(gen)
        need = next((k for k in range(1, len(gen) + 1) if answer in tok.decode(gen[:k])), None)
        seq = probe.fork(base)
        logits = probe.teacher_force(seq, q, gen)
        probe.release(seq)
        refs.append((kind, q, gen, need, logits, answer in text))
    seq = probe.fork(base)
    held_ref = probe.teacher_force(seq, item["held"][:1], item["held"][1:])
    probe.release(seq)
    for spec in specs:
        t0 = time.perf_counter()
        comp = probe.compress(base, spec)
        ratio = comp.kv.device_bytes() / full_bytes
        row = rows[spec]
        row["device_bytes_ratio"].append(ratio)
        for kind, q, gen, need, ref_logits, full_ok in refs:
            seq = probe.fork(comp)
            logits = probe.teacher_force(seq, q, gen)
            peak = seq.kv.device_bytes() / full_bytes
            probe.release(seq)
            kl, agree = kl_and_agreement(ref_logits, logits)
            row["kl"].append(kl)
            row["agree"].append(agree)
            row["peak_ratio"].append(peak)
            if full_ok and need is not None:
                ok = bool((ref_logits[:need].argmax(-1) == logits[:need].argmax(-1)).all())
                row[f"acc_{kind}"].append(float(ok))
        seq = probe.fork(comp)
        held = probe.teacher_force(seq, item["held"][:1], item["held"][1:])
        store = seq.kv.extra.get("sentences")
        if store is not None:
            row["recall_s"].append(store.recall_s)
        probe.release(seq)
        targets = torch.tensor(item["held"][1:])
        row["nll"].append(float(torch.nn.functional.cross_entropy(held[:-1], targets)))
        row["nll_full"].append(float(torch.nn.functional.cross_entropy(held_ref[:-1], targets)))
        probe.release(comp)
        row["seconds"].append(time.perf_counter() - t0)
    rows["full"]["full_answers"].append(sum(r[5] for r in refs))
    probe.release(base)


def memory_trace(lm: Any, env: PolicyEnv, specs: list[str], prompt: list[int], gen: int) -> dict[str, list]:
    """Device bytes of one sequence after every step of a long generation, per policy."""
    traces = {}
    for spec in specs:
        eng = LLMEngine(lm.model, EngineConfig(kv_pool_bytes=1 << 30, max_num_batched_tokens=512))
        eng.policy_env = env
        rid = eng.add_request(prompt, SamplingParams(max_tokens=gen, ignore_eos=True), policy=spec)
        points = []
        while rid in eng.requests:
            seq = eng.requests[rid]
            eng.step()
            if seq.num_computed_tokens >= len(prompt) and rid in eng.requests:
                held = seq.kv.device_bytes() if seq.kv is not None else len(seq.block_table) * eng.pool.bytes_per_block
                points.append((seq.num_computed_tokens, held))
        traces[spec] = points
    return traces


def summarize(rows: dict) -> dict[str, dict[str, float]]:
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    out = {}
    for spec, r in rows.items():
        if spec == "full":
            continue
        acc = r["acc_passkey"] + r["acc_word"]
        out[spec] = {
            "passkey_acc": mean(r["acc_passkey"]),
            "needle_acc": mean(acc),
            "kl_mean": mean(r["kl"]),
            "greedy_agreement": mean(r["agree"]),
            "device_bytes_ratio": mean(r["device_bytes_ratio"]),
            "peak_device_bytes_ratio": mean(r["peak_ratio"]),
            "ppl": math.exp(mean(r["nll"])),
            "ppl_full": math.exp(mean(r["nll_full"])),
            "n_passkey": len(r["acc_passkey"]),
            "recall_ms": 1e3 * mean(r["recall_s"]) if r["recall_s"] else 0.0,
            "seconds": sum(r["seconds"]),
        }
    return out


def write_report(out: Path, summary: dict, traces: dict, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    lines = [
        "# KV policy quality vs the full cache (SmolLM2-135M-Instruct, Wikipedia contexts)", "",
        (
            f"contexts: {meta['items']} (lengths {meta['lengths']}, depths {meta['depths']}); "
            f"full cache answers {meta['full_answers']} of {2 * meta['items']} needle questions"
        ),
        "",
        "| policy | device bytes / full | passkey acc | needle acc | KL mean | greedy agree | ppl (full) | recall ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for spec, s in summary.items():
        lines.append(
            f"| {spec} | {s['device_bytes_ratio']:.3f} | {s['passkey_acc']:.2f} (n={s['n_passkey']}) | "
            f"{s['needle_acc']:.2f} | {s['kl_mean']:.4f} | {s['greedy_agreement']:.3f} | "
            f"{s['ppl']:.2f} ({s['ppl_full']:.2f}) | {s['recall_ms']:.1f} |"
        )
    (out / "quality.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    by_policy: dict[str, list] = defaultdict(list)
    for spec, s in summary.items():
        by_policy[spec.split("-")[0] if not spec.startswith("quant") else spec].append(s)
    for name, pts in by_policy.items():
        pts = sorted(pts, key=lambda s: s["device_bytes_ratio"])
        xs = [p["device_bytes_ratio"] for p in pts]
        axes[0].plot(xs, [p["needle_acc"] for p in pts], marker="o", label=name)
        axes[1].plot(xs, [p["kl_mean"] for p in pts], marker="o", label=name)
    axes[0].set(xlabel="device-tier KV bytes / full cache", ylabel="needle accuracy", title="memory vs retrieval")
    axes[1].set(xlabel="device-tier KV bytes / full cache", ylabel="KL(full || policy)", title="memory vs KL", yscale="log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=120)
    fig, ax = plt.subplots(figsize=(7, 4))
    for spec, pts in traces.items():
        ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], label=spec)
    ax.set(xlabel="token position", ylabel="device-tier KV MiB (one sequence)", title="device bytes over a long generation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "memory_vs_position.png", dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 contexts, short memory trace")
    ap.add_argument("--out", default="reports/quality")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1 if args.quick else 2)
    lengths, depths = ([512, 1024], [0.5]) if args.quick else ([512, 1024, 2048], [0.1, 0.5, 0.9])
    lm = load_model()
    tok = lm.tokenizer
    env = PolicyEnv.from_tokenizer(tok)
    engine = LLMEngine(lm.model, EngineConfig(kv_pool_bytes=2 << 30, max_num_batched_tokens=512))
    engine.policy_env = env
    probe = Probe(engine)
    specs = [f"{p}-{b}" for p in EVICTING for b in BUDGETS] + list(QUANT)
    rows: dict = defaultdict(lambda: defaultdict(list))
    items = build_items(tok, lengths, depths)
    t0 = time.perf_counter()
    for item in items:
        evaluate_item(probe, tok, item, specs, rows)
    gen, trace_prompt = (48, 128) if args.quick else (384, 256)
    trace_specs = ["full", "streaming-0.25", "h2o-0.25", "snapkv-0.25", "gkv-0.25", "spindlekv-0.25",
                   "sentencekv-0.25", "quant-bits_8", "quant-bits_4"]
    traces = memory_trace(lm, env, trace_specs, items[0]["context"][:trace_prompt], gen)
    summary = summarize(rows)
    meta = {"items": len(items), "lengths": lengths, "depths": depths,
            "full_answers": sum(rows["full"]["full_answers"]), "seconds": time.perf_counter() - t0}
    write_report(Path(args.out), summary, traces, meta)
    print(Path(args.out, "quality.md").read_text())
    keys = ("passkey_acc", "kl_mean", "greedy_agreement", "device_bytes_ratio")
    print(json.dumps({"bench": "quality", "meta": meta,
                      "policies": {s: {k: round(v[k], 4) for k in keys} for s, v in summary.items()}}))


if __name__ == "__main__":
    main()
