"""The tier benchmark on CUDA (issue 17): restore throughput and demotion overlap.

``python -m bench.tiers --device cuda --quick`` on random weights of a real shape (default
Llama-3.1-8B, bf16; ``--model-shape``), one process, measures:

- ``restore_gbps``: host -> device bytes per second through the engine's own promote path
  (``TierManager.promote`` on a 2k-token prompt demoted to the pinned host tier, timed to the
  copy's completion: ``torch.cuda.synchronize``), best of ``repeats``;
- ``pinned_memcpy_gbps``: one contiguous pinned host -> device ``copy_`` of the same bytes in
  the same run; ``restore_over_memcpy`` = the ratio (target >= 0.7);
- ``decode_step_ms``: a decode batch's step time, median of steps without a demotion in flight
  and mean of the steps while ``demote_all`` moves ~``demote_bytes`` (1 GiB) of cached blocks
  to host on the copy stream (the step that enqueues it included, and also reported alone:
  ``enqueue_step_ms``, ``after_enqueue_ms``); ``decode_with_over_without`` = their ratio
  (target <= 1.1), with the copier's paced demotion (``DeviceCopier.max_inflight_bytes``), and
  again with the demotion enqueued whole (``decode_step_ms_unpaced``, the same run's peer).

The last stdout line is one JSON object with ``targets_met``. The same code runs on the CPU
(``run_device("cpu", "tiny", ...)``, float32, plain memory) so that tests cover it there.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.engine_gpu import attempt, load_device_model, sized_prompts
from cache_node.config import EngineConfig, resolve_device
from cache_node.engine import LLMEngine
from cache_node.kv_pool import KVPool
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence
from cache_node.tiers.manager import TierConfig
from workloads.corpus import load_corpus

GB = 1e9


def _engine(lm: LoadedModel, device: torch.device, dtype: torch.dtype, pool_bytes: int, host_bytes: int) -> LLMEngine:
    cfg = EngineConfig(block_size=16, kv_pool_bytes=pool_bytes, max_num_batched_tokens=4096, max_num_seqs=16,
                       device=str(device), dtype=str(dtype).removeprefix("torch."))
    return LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids, tier_config=TierConfig(host_bytes=host_bytes))


def restore_gbps(engine: LLMEngine, prompt: list[int], repeats: int) -> tuple[float, int]:
    """(GB/s, bytes) restoring ``prompt``'s blocks from the host tier through ``promote``."""
    tiers, timings, n = engine.tiers, [], 0
    keys = (engine.config.cache_namespace_default, engine.model_id, engine.kv_format)
    for _ in range(repeats):
        engine.flush()
        engine.generate([prompt], SamplingParams(max_tokens=1))
        engine.demote_all()
        engine.wait_for_transfers()
        seq = Sequence("restore", prompt, SamplingParams(), extra_keys=keys)
        with engine._lock:
            _sync(engine.pool.kv.device)
            t0 = time.perf_counter()
            n = len(tiers.promote(seq, []))
            _sync(engine.pool.kv.device)
            timings.append(time.perf_counter() - t0)
        if n != (len(prompt) - 1) // 16:
            raise RuntimeError(f"restored {n} blocks, expected {(len(prompt) - 1) // 16}")
    nbytes = n * engine.pool.bytes_per_block
    return nbytes / min(timings) / GB, nbytes


def pinned_memcpy_gbps(nbytes: int, device: torch.device, repeats: int) -> float:
    """One contiguous pinned host -> device copy of ``nbytes``, best of ``repeats`` (a plain
    memcpy on the CPU)."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_ms(engine: LLMEngine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return (time.perf_counter() - t0) * 1000


def decode_with_demotion(engine: LLMEngine, cached: list[list[int]], decoders: list[list[int]],
                         steps: int) -> dict[str, Any]:
    """Decode step times without and with a concurrent demotion of ``cached``'s blocks."""
    engine.flush()
    engine.generate(cached, SamplingParams(max_tokens=1))  # their blocks stay cached, free
    demote_blocks = sum(1 for b in engine.kv_manager.pool.free_queue if b.block_hash is not None)
    params = SamplingParams(max_tokens=4 * steps + 64, ignore_eos=True)
    for p in decoders:
        engine.add_request(p, params, cache_namespace="decode")
    for _ in range(8):  # prefill and warm-up
        engine.step()
    without = [_step_ms(engine) for _ in range(steps)]
    copier = engine.tiers.copier
    calls_before = copier.copy_calls
    with_demotion = [_step_ms_with(engine, lambda: engine.demote_all())]
    while engine.tiers.copier.num_held or len(with_demotion) < 3:
        with_demotion.append(_step_ms(engine))
    demote_calls = copier.copy_calls - calls_before
    for seq_id in list(engine.requests):
        engine.abort_request(seq_id)
    while engine.has_unfinished_requests():
        engine.step()
    base = statistics.median(without)
    mean_with = statistics.fmean(with_demotion)
    return {"demoted_bytes": demote_blocks * engine.pool.bytes_per_block, "batch": len(decoders),
            "without_ms": round(base, 3), "with_ms": round(mean_with, 3), "steps_with": len(with_demotion),
            "enqueue_step_ms": round(with_demotion[0], 3),
            "after_enqueue_ms": round(statistics.fmean(with_demotion[1:]), 3), "ratio": mean_with / base,
            "copy_backend": copier.copy_backend, "demotion_copy_calls": demote_calls,
            "max_inflight_bytes": copier.max_inflight_bytes}


def _unpaced(engine: LLMEngine, cached: list[list[int]], decoders: list[list[int]],
             steps: int) -> dict[str, Any]:
    """``decode_with_demotion`` again with the demotion enqueued whole (the copier's
    ``max_inflight_bytes`` None, then put back): the same run's figure without pacing."""
    copier = engine.tiers.copier
    paced = copier.max_inflight_bytes
    try:
        copier.max_inflight_bytes = None
        return decode_with_demotion(engine, cached, decoders, steps)
    finally:
        copier.max_inflight_bytes = paced


def _step_ms_with(engine: LLMEngine, before: Any) -> float:
    t0 = time.perf_counter()
    before()
    engine.step()
    return (time.perf_counter() - t0) * 1000


def run_device(device_name: str, shape: str | None, quick: bool, demote_bytes: int = 1 << 30) -> dict[str, Any]:
    """The device tier bench (module docstring); bf16 on CUDA, float32 on the CPU."""
    device = resolve_device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lm = load_device_model(shape, None, device, dtype, None, 0)
    assert lm.tokenizer is not None
    mc = lm.model.config
    per_token = KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads,
                                       mc.hidden_size // mc.num_attention_heads, dtype)
    cached_tokens = demote_bytes // per_token
    engine = _engine(lm, device, dtype, pool_bytes=2 * demote_bytes + 16384 * per_token,
                     host_bytes=2 * demote_bytes + 4096 * per_token)
    corpus = load_corpus()
    prompt_2k = sized_prompts(lm.tokenizer, corpus, 1, 2048, 2048, seed=1)[0]
    errors: dict[str, str] = {}
    restore = attempt("restore", lambda: restore_gbps(engine, prompt_2k, 3 if quick else 5), errors)
    nbytes = restore[1] if restore else (len(prompt_2k) - 1) // 16 * engine.pool.bytes_per_block
    memcpy = attempt("pinned_memcpy", lambda: pinned_memcpy_gbps(nbytes, device, 5), errors)
    cached = sized_prompts(lm.tokenizer, corpus, max(1, cached_tokens // 2048), 2048, 2048, seed=2)
    decoders = sized_prompts(lm.tokenizer, corpus, 8, 256, 512, seed=3)
    decode = attempt("decode", lambda: decode_with_demotion(engine, cached, decoders, 10 if quick else 30),
                      errors)
    unpaced = attempt("decode_unpaced", lambda: _unpaced(engine, cached, decoders, 10 if quick else 30), errors)
    attempt("integrity", lambda: (engine.wait_for_transfers(), engine.check_integrity()), errors)
    ratio = restore[0] / memcpy if restore and memcpy else None
    slow = decode["ratio"] if decode else None
    return {"bench": "tiers", "mode": "device", "quick": quick, "model_shape": shape or "llama-3.1-8b",
            "restore_gbps": restore and round(restore[0], 2), "restore_bytes": nbytes,
            "pinned_memcpy_gbps": memcpy and round(memcpy, 2), "restore_over_memcpy": ratio,
            "decode_step_ms": decode, "decode_with_over_without": slow,
            "decode_step_ms_unpaced": unpaced, "errors": errors,
            "targets_met": {"restore_ge_0.7_memcpy": ratio is not None and ratio >= 0.7,
                            "decode_with_demotion_within_10pct": slow is not None and slow <= 1.1}}
