"""Tier benchmark: restore throughput per tier and TTFT from each tier, on the real model.

``python -m bench.tiers [--quick]`` measures, in one run on this machine:

- ``memcpy_gbps``: one large contiguous ``torch`` copy (the restore ceiling for host RAM);
- ``disk_read_gbps``: sequential ``readinto`` of the spill group files, page cache dropped
  first (``posix_fadvise(DONTNEED)``), the ceiling for spill-disk restores;
- ``restore_gbps``: bytes per second from each tier into device blocks through the engine's
  own paths (host: ``TierManager.promote``; spill RAM / disk: ``SpillStore.get`` then
  ``TierManager.install``), disk with the page cache dropped the same way;
- ``ttft_ms``: time to first token of a 1k- and a 2k-token prompt whose prefix sits on the
  device, in host, in spill RAM, on spill disk, or nowhere (recompute).

The last stdout line is one JSON object with those keys plus ``ratios`` (host/memcpy,
disk/disk-read, tier TTFT/recompute) and ``targets_met``. ``--device cuda`` runs the CUDA
tier bench instead (``bench.tiers_gpu``: restore vs pinned memcpy, decode with a concurrent
demotion).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel, load_model
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence
from cache_node.tiers.manager import TierConfig
from cache_node.tiers.spill_api import from_numpy
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillStore
from workloads.corpus import load_corpus

GB = 1e9
TIERS = ("device", "host", "spill_ram", "spill_disk")


def corpus_prompt(lm: LoadedModel, num_tokens: int, offset: int = 0) -> list[int]:
    """``num_tokens`` token ids of real Wikipedia text (article summaries from ``offset``)."""
    assert lm.tokenizer is not None
    ids: list[int] = []
    for article in load_corpus()[offset:]:
        ids += lm.tokenizer.encode(article.extract + "\n\n")
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"corpus has fewer than {num_tokens} tokens")


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to drop the cached pages of ``paths`` (clean pages of our own files)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def best_of(n: int, fn: Callable[[], float]) -> float:
    """Smallest of ``n`` timings (seconds) returned by ``fn``."""
    return min(fn() for _ in range(n))


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)

    def once() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    return nbytes / best_of(repeats, once) / GB


def disk_read_gbps(paths: list[Path], repeats: int) -> float:
    total = sum(p.stat().st_size for p in paths)
    buf = bytearray(max(p.stat().st_size for p in paths))

    def once() -> float:
        drop_page_cache(paths)
        t0 = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                f.readinto(buf)
        return time.perf_counter() - t0

    return total / best_of(repeats, once) / GB


class TierBench:
    """One engine with a host tier and an in-process spill store, and the prompts to move."""

    def __init__(self, lm: LoadedModel, root: Path, quick: bool) -> None:
        self.lm, self.root, self.repeats = lm, root, 1 if quick else 3
        self.restore_repeats = 3 if quick else 5
        cfg = EngineConfig(block_size=16, kv_pool_bytes=512 << 20, max_num_batched_tokens=2048,
                           max_num_seqs=4)
        probe = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids)
        fmt = BlockFormat(*probe.spill_block_spec())
        del probe
        self.store = SpillStore(root, fmt, ram_bytes=1 << 30, disk_bytes=4 << 30)
        self.engine = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids,
                                tier_config=TierConfig(host_bytes=512 << 20), spill=self.store)

    def place(self, tier: str) -> None:
        """Move every cached block of the engine to ``tier`` (device = leave it)."""
        eng = self.engine
        if tier == "host":
            eng.demote_all()
        elif tier in ("spill_ram", "spill_disk"):
            eng.demote_all(to_spill=True)
            eng.wait_for_transfers()
            if tier == "spill_disk":
                self.store.demote_to_disk()
                drop_page_cache(self.files())

    def files(self) -> list[Path]:
        return sorted(self.root.glob("*.kvs"))

    def ttft_ms(self, prompt: list[int], tier: str) -> float:
        """Median TTFT of ``prompt`` with its prefix placed in ``tier`` ("recompute": nowhere)."""
        times = []
        for _ in range(self.repeats):
            self.engine.flush()
            self.engine.generate([prompt], SamplingParams(max_tokens=1))
            if tier != "recompute":
                self.place(tier)
            else:
                self.engine.flush()
            out = self.engine.generate([prompt], SamplingParams(max_tokens=1))[0]
            want = 0 if tier == "recompute" else (len(prompt) - 1) // 16 * 16
            if out.num_cached_tokens_by_tier.get(tier, out.num_cached_tokens) != want:
                raise RuntimeError(f"{tier}: expected {want} cached tokens, got {out}")
            times.append((out.ttft_s or 0.0) * 1000)
        return statistics.median(times)

    def seq_of(self, prompt: list[int]) -> Sequence:
        eng = self.engine
        keys = (eng.config.cache_namespace_default, eng.model_id, eng.kv_format)
        return Sequence("bench", prompt, SamplingParams(), extra_keys=keys)

    def restore_gbps(self, prompt: list[int], tier: str) -> float:
        """Bytes per second restoring ``prompt``'s blocks from ``tier`` into device blocks."""
        eng, tiers = self.engine, self.engine.tiers
        timings = []
        for _ in range(self.restore_repeats):
            eng.flush()
            eng.generate([prompt], SamplingParams(max_tokens=1))
            self.place(tier)
            seq = self.seq_of(prompt)
            with eng._lock:
                t0 = time.perf_counter()
                if tier == "host":
                    n = len(tiers.promote(seq, []))
                else:
                    start, hashes = tiers.spill_candidates(seq)
                    hits = self.store.get(hashes)
                    n = tiers.install(seq, start, from_numpy(hits.blocks, eng.pool.kv.dtype), hits.tiers)
                timings.append(time.perf_counter() - t0)
            if n != (len(prompt) - 1) // 16:
                raise RuntimeError(f"{tier}: restored {n} blocks")
        return n * eng.pool.bytes_per_block / min(timings) / GB


def run(quick: bool) -> dict[str, object]:
    lm = load_model()
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-", dir=os.environ.get("KVSTRATA_BENCH_DIR")) as tmp:
        bench = TierBench(lm, Path(tmp), quick)
        prompts = {"1k": corpus_prompt(lm, 1024), "2k": corpus_prompt(lm, 2048, offset=40)}
        restore = {t: bench.restore_gbps(prompts["2k"], t) for t in ("host", "spill_ram", "spill_disk")}
        bench.place("spill_disk")
        restored_bytes = (2048 - 1) // 16 * bench.engine.pool.bytes_per_block
        copy = memcpy_gbps(restored_bytes, 5)
        disk = disk_read_gbps(bench.files(), 3)
        ttft = {k: {t: bench.ttft_ms(p, t) for t in (*TIERS, "recompute")} for k, p in prompts.items()}
    return summarize(restore, copy, disk, ttft)


def summarize(restore: dict[str, float], copy: float, disk: float,
              ttft: dict[str, dict[str, float]]) -> dict[str, object]:
    ratios: dict[str, float] = {
        "host_restore_over_memcpy": restore["host"] / copy,
        "disk_restore_over_disk_read": restore["spill_disk"] / disk,
    }
    for size, row in ttft.items():
        for tier in TIERS:
            ratios[f"ttft_{size}_{tier}_over_recompute"] = row[tier] / row["recompute"]
    met = {
        "host_restore_ge_half_memcpy": ratios["host_restore_over_memcpy"] >= 0.5,
        "disk_restore_ge_half_disk_read": ratios["disk_restore_over_disk_read"] >= 0.5,
        "ttft_every_tier_below_recompute": all(
            v < 1.0 for k, v in ratios.items() if k.startswith("ttft_")),
    }
    return {"restore_gbps": restore, "memcpy_gbps": copy, "disk_read_gbps": disk,
            "ttft_ms": ttft, "ratios": ratios, "targets_met": met}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 TTFT repetition and 3 restore repetitions (full: 3 and 5)")
    parser.add_argument("--device", default="cpu", help="cpu (this bench) or cuda[:i] (bench.tiers_gpu)")
    parser.add_argument("--model-shape", default=None, choices=["llama-3.1-8b", "smollm2-135m"],
                        help="random-weight shape in device mode (default llama-3.1-8b)")
    args = parser.parse_args(argv)
    if args.device != "cpu":
        from bench.tiers_gpu import run_device

        print(json.dumps(run_device(args.device, args.model_shape, args.quick)))
        return 0
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = run(args.quick)
    for key in ("restore_gbps", "ttft_ms", "ratios", "targets_met"):
        print(f"{key}: {json.dumps(result[key], indent=1)}", file=sys.stderr)
    print(f"memcpy {result['memcpy_gbps']:.2f} GB/s, disk read {result['disk_read_gbps']:.2f} GB/s")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
