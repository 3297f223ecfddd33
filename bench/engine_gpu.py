"""The engine benchmark on a device with random weights of a real shape (issue 17).

``python -m bench.engine --device cuda --model-shape llama-3.1-8b --quick`` runs, in one
process and on one workload (``num_requests`` chat prompts of ``min_prompt_tokens`` to
``max_prompt_tokens`` tokens of real Wikipedia text, ``max_tokens`` new tokens each):

(a) ``hf_generate`` — transformers ``generate`` one request at a time (SDPA), on the first
    ``hf_generate_requests`` prompts (at ~20 tok/s the whole workload would take minutes);
(b) ``hf_continuous_batching`` — ``generate_batch`` with SDPA over the whole workload;
(c) ``kvstrata`` — ``LLMEngine`` on the device, all requests at once.

Weights are random (a fixed seed; bf16 on CUDA) unless ``--model-path`` names a checkpoint;
(a)/(b) use a copy of the same weights. EOS never stops a request (random weights would make
lengths arbitrary): every system generates exactly ``max_tokens`` tokens per request
(transformers with ``eos_token_id=None``, kvstrata with ``ignore_eos``), and the result says
whether that held. Then, on kvstrata alone: one request alone (TTFT and single-stream decode
tok/s = (tokens - 1) / (wall - TTFT)), and the shared-prefix case at ``prefix_doc_tokens``.

The decode roofline is the weight bytes read once per step at ``hbm_bandwidth`` bytes/s:
``roofline_tokens_per_s(batch) = batch * bandwidth / weight_bytes``; the result reports the
fraction of it reached by kvstrata at the workload's batch and by the single stream. Targets
(issue 17): kvstrata >= 5x continuous batching, one stream >= 100 tok/s, prefix-hit TTFT <=
0.1x cold. The tokenizer and the corpus come from the GPU carry folder (``bench.gpu_carry``)
when the installed ones are missing.
"""

from __future__ import annotations

import copy
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from typing_extensions import Self  # typing.Self needs Python 3.11; the project allows 3.10

from bench.common import chat_prompt, median, shared_document
from bench.engine_systems import (
    PREFIX_QUESTIONS,
    PrefixCase,
    cb_config,
    generation_config,
    run_engine,
    run_hf_continuous_batching,
    run_hf_generate,
    run_prefix_case,
)
from bench.gpu_profile import profile_engine
from cache_node.config import EngineConfig, resolve_device
from cache_node.engine import LLMEngine
from cache_node.kv_pool import KVPool
from cache_node.model_loader import LoadedModel, load_model
from cache_node.model_shapes import MODEL_SHAPES, shape_config
from cache_node.model_shapes import random_model as shapes_random_model
from cache_node.sampling_params import SamplingParams
from workloads.corpus import Article, load_corpus

T = TypeVar("T")
SHAPES = (*MODEL_SHAPES, "tiny")
"""Model shapes: ``cache_node.model_shapes`` (Llama-3.1-8B, SmolLM2-135M) and ``tiny`` (CPU tests:
the SmolLM2 shape cut to 2 layers of width 64)."""
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128}


@dataclass(frozen=True)
class GpuBenchConfig:
    """Sizes of one device run (see the module docstring); ``hbm_bandwidth`` in bytes/s."""

    num_requests: int = 32
    min_prompt_tokens: int = 256
    max_prompt_tokens: int = 1024
    max_tokens: int = 128
    hf_generate_requests: int = 2
    prefix_doc_tokens: int = 2048
    prefix_rounds: int = 1
    prefix_hits_per_round: int = 3
    hbm_bandwidth: float = 4.8e12
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    seed: int = 0
    prefill_graph_max_tokens: int = 256  # EngineConfig's; 0: no prefill graphs
    fused_kernels: int = 1  # EngineConfig's, as 0/1 (a command-line integer)

    def __post_init__(self) -> None:
        for name in ("num_requests", "min_prompt_tokens", "max_tokens", "hf_generate_requests",
                     "prefix_doc_tokens", "prefix_rounds", "prefix_hits_per_round"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens < self.min_prompt_tokens:
            raise ValueError("max_prompt_tokens < min_prompt_tokens")
        if self.hbm_bandwidth <= 0:
            raise ValueError(f"hbm_bandwidth must be > 0 bytes/s, got {self.hbm_bandwidth}")


QUICK_GPU = GpuBenchConfig()
FULL_GPU = GpuBenchConfig(num_requests=64, hf_generate_requests=4, prefix_rounds=3)


def random_model(shape: str, dtype: torch.dtype, device: torch.device, tokenizer: PreTrainedTokenizerBase,
                 seed: int = 0) -> LoadedModel:
    """``cache_node.model_shapes.random_model`` of ``shape`` with ``tokenizer`` attached (its
    special token ids in the config). ``tiny``: SmolLM2's vocabulary, 2 layers of width 64.

    Raises:
        ValueError: unknown shape.
    """
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    config = shape_config("smollm2-135m", **TINY, **ids) if shape == "tiny" else shape_config(shape, **ids)
    lm = shapes_random_model(config, dtype, device, seed)
    lm.model_id = lm.model_id.replace("llama-h", f"{shape}-h")
    lm.tokenizer = tokenizer
    return lm


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameter tensors (tied embeddings counted once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def sized_prompts(tok: PreTrainedTokenizerBase, corpus: Sequence[Article], n: int, lo: int, hi: int,
                  seed: int = 0) -> list[list[int]]:
    """``n`` chat prompts of ``lo..hi`` tokens (uniform) of Wikipedia extracts plus one question."""
    rng = random.Random(seed)
    order = list(corpus)
    rng.shuffle(order)
    overhead = len(chat_prompt(tok, "Summarize the text above.\n\n"))
    out, k = [], 0
    for _ in range(n):
        target = rng.randint(lo, hi)
        ids: list[int] = []
        while len(ids) < target:
            ids += tok.encode(f"## {order[k % len(order)].title}\n{order[k % len(order)].extract}\n\n",
                              add_special_tokens=False)
            k += 1
        body = tok.decode(ids[: max(target - overhead, 1)])
        out.append(chat_prompt(tok, f"{body}\n\nSummarize the text above."))
    return out


def _engine(lm: LoadedModel, prompts: Sequence[Sequence[int]], cfg: GpuBenchConfig, device: torch.device,
            dtype: torch.dtype) -> LLMEngine:
    mc = lm.model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    per_token = KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, dtype)
    tokens = sum(len(p) + cfg.max_tokens + cfg.block_size for p in prompts) + 4 * (cfg.prefix_doc_tokens + 256)
    config = EngineConfig(block_size=cfg.block_size, kv_pool_bytes=int(tokens * per_token * 1.25),
                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                          max_num_seqs=max(cfg.num_requests, 8), device=str(device),
                          dtype=str(dtype).removeprefix("torch."),
                          prefill_graph_max_tokens=cfg.prefill_graph_max_tokens,
                          fused_kernels=bool(cfg.fused_kernels))
    return LLMEngine(lm.model, config, lm.model_id, lm.eos_token_ids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Any) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


class StepProfile:
    """Wall time of every ``engine.step`` while installed (``with``), with how many requests
    got a token in it: steps where all ``full`` requests decode are the batch's decode steps,
    to compare with the decode roofline; the rest hold prefill chunks (or a draining tail)."""

    def __init__(self, engine: LLMEngine, full: int) -> None:
        self.engine, self.full = engine, full
        self.steps: list[tuple[float, int]] = []

    def __enter__(self) -> Self:
        inner = self.engine.step

        def timed() -> Any:
            t0 = time.perf_counter()
            out = inner()
            self.steps.append((time.perf_counter() - t0, len(out)))
            return out
        self.engine.step = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.step  # the class's method again

    def summary(self) -> dict[str, Any]:
        full = [t for t, n in self.steps if n >= self.full]
        rest = [t for t, n in self.steps if n < self.full]
        graphs, prefill = self.engine.runner.graphs, self.engine.runner.prefill_graphs
        return {"steps": len(self.steps), "full_batch_decode_steps": len(full),
                "full_batch_decode_step_ms_median": round(median(full) * 1000, 3) if full else None,
                "other_steps": len(rest), "other_steps_s": round(sum(rest), 3),
                "graph_buckets": sorted(graphs.graphs) if graphs is not None else None,
                "prefill_graph_buckets": sorted(prefill.graphs) if prefill is not None else None}


def _single_stream(engine: LLMEngine, prompt: list[int], max_tokens: int, device: torch.device) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    [out], wall = _timed(device, lambda: engine.generate([prompt], params, cache_namespace="single-stream"))
    ttft = out.ttft_s or 0.0
    n = len(out.output_token_ids)
    return {"prompt_tokens": len(prompt), "ttft_s": round(ttft, 4), "wall_s": round(wall, 4),
            "decode_tokens_per_s": round((n - 1) / max(wall - ttft, 1e-9), 2)}


def attempt(name: str, fn: Callable[[], T], errors: dict[str, str]) -> T | None:
    """``fn()``, or None with the error recorded under ``name`` (one system failing on the
    device must not lose the other systems' figures from a scarce GPU run)."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the result and printed in full
        traceback.print_exc()
        errors[name] = f"{type(exc).__name__}: {exc}"[:500]
        return None
    print(f"[bench] {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def _no_eos_reference(lm: LoadedModel, pad: int, max_tokens: int) -> tuple[torch.nn.Module, Any, Any]:
    """A copy of the weights with SDPA and no EOS anywhere transformers could merge one in from,
    plus the generation configs of the run and of the warm-up."""
    ref = copy.deepcopy(lm.model)
    if hasattr(ref, "set_attn_implementation"):
        ref.set_attn_implementation("sdpa")
    ref.config.eos_token_id = ref.generation_config.eos_token_id = None
    gens = []
    for n in (max_tokens, 4):
        gen = generation_config(n, [], pad)
        gen.eos_token_id = None  # random weights: never stop early
        gens.append(gen)
    return ref, gens[0], gens[1]


def run_device_bench(tok: PreTrainedTokenizerBase, lm: LoadedModel, cfg: GpuBenchConfig, device: torch.device,
                     dtype: torch.dtype, shape: str, quick: bool) -> dict[str, Any]:
    """kvstrata (throughput, single stream, prefix case) first, then transformers (a) and (b);
    the JSON result. A system that raises is recorded under ``errors``."""
    corpus = load_corpus()
    prompts = sized_prompts(tok, corpus, cfg.num_requests, cfg.min_prompt_tokens, cfg.max_prompt_tokens, cfg.seed)
    ref, gen, warm_gen = _no_eos_reference(lm, tok.pad_token_id if tok.pad_token_id is not None else 0,
                                           cfg.max_tokens)
    wbytes = weight_bytes(lm.model)
    engine = _engine(lm, prompts, cfg, device, dtype)
    errors: dict[str, str] = {}
    runs: dict[str, tuple[list[list[int]], float] | None] = {}
    attempt("kvstrata_warmup", lambda: run_engine(engine, prompts[:1], 4, cache_namespace="warmup",
                                                   ignore_eos=True), errors)
    steps = StepProfile(engine, len(prompts))
    with steps:
        runs["kvstrata"] = attempt("kvstrata", lambda: _timed(device, lambda: run_engine(
            engine, prompts, cfg.max_tokens, cache_namespace="bench", ignore_eos=True)), errors)
    single = attempt("single_stream", lambda: _single_stream(engine, prompts[-1], cfg.max_tokens, device), errors)
    doc = shared_document(tok, corpus, cfg.prefix_doc_tokens, seed=cfg.seed + 1)
    prefix = attempt("prefix", lambda: run_prefix_case(engine, tok, doc, cfg.prefix_rounds,
                                                        cfg.prefix_hits_per_round, 1), errors)
    prefix_eager = None
    if engine.runner.prefill_graphs is not None:  # the same case with the hit's chunk run eagerly
        prefix_eager = attempt("prefix_eager", lambda: _without_prefill_graphs(engine, lambda: run_prefix_case(
            engine, tok, doc, cfg.prefix_rounds, cfg.prefix_hits_per_round, 1)), errors)
    attempt("integrity", lambda: (engine.wait_for_transfers(), engine.check_integrity()), errors)
    questions = [chat_prompt(tok, f"{doc}\n\nQuestion: {q}") for q in PREFIX_QUESTIONS[:2]]
    profile = attempt("profile", lambda: profile_engine(engine, prompts, (questions[0], questions[1])), errors)
    hf = prompts[: cfg.hf_generate_requests]
    attempt("hf_warmup", lambda: run_hf_generate(ref, prompts[:1], warm_gen), errors)
    runs["hf_generate"] = attempt("hf_generate", lambda: _timed(device, lambda: run_hf_generate(ref, hf, gen)),
                                   errors)
    cbc = cb_config(prompts, cfg.max_tokens, cfg.max_num_batched_tokens)
    attempt("cb_warmup", lambda: run_hf_continuous_batching(ref, prompts[:1], warm_gen, cbc), errors)
    runs["hf_continuous_batching"] = attempt("hf_continuous_batching", lambda: _timed(
        device, lambda: run_hf_continuous_batching(ref, prompts, gen, cbc)), errors)
    done = {n: r for n, r in runs.items() if r is not None}
    result = device_result({n: r[0] for n, r in done.items()}, {n: r[1] for n, r in done.items()}, prompts,
                           single, prefix, wbytes, cfg, prefix_eager)
    return result | {"model_shape": shape, "dtype": str(dtype).removeprefix("torch."), "quick": quick,
                     "errors": errors, "kvstrata_steps": steps.summary(), "profile": profile}


def _without_prefill_graphs(engine: LLMEngine, run: Callable[[], T]) -> T:
    """``run()`` with the engine's prefill graphs off (eager prefill steps), then back on."""
    graphs, engine.runner.prefill_graphs = engine.runner.prefill_graphs, None
    try:
        return run()
    finally:
        engine.runner.prefill_graphs = graphs


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def device_result(outs: dict[str, list[list[int]]], wall: dict[str, float], prompts: Sequence[Sequence[int]],
                  single: dict[str, float] | None, prefix: PrefixCase | None, wbytes: int,
                  cfg: GpuBenchConfig, prefix_eager: PrefixCase | None = None) -> dict[str, Any]:
    """The JSON result of a device run from what finished (pure: tested on the CPU). A ratio
    whose inputs are missing is None, and a target that cannot be judged is not met.
    ``prefix_eager``: the prefix case again with prefill graphs off (reported, not judged)."""
    tps = {n: sum(len(o) for o in outs[n]) / wall[n] for n in outs}
    step_s = wbytes / cfg.hbm_bandwidth
    roof_batch = cfg.num_requests / step_s
    ratio_cb = _ratio(tps.get("kvstrata"), tps.get("hf_continuous_batching"))
    prefix_ratio = prefix.ratio if prefix is not None else None
    decode = single["decode_tokens_per_s"] if single is not None else None
    plens = [len(p) for p in prompts]
    r = {
        "bench": "engine", "mode": "device", "num_requests": len(prompts), "max_tokens": cfg.max_tokens,
        "prompt_tokens": {"min": min(plens), "median": median(plens), "max": max(plens), "total": sum(plens)},
        "hf_generate_requests": len(outs.get("hf_generate", [])),
        "generated_tokens": {n: sum(len(o) for o in v) for n, v in outs.items()},
        "all_full_length": all(len(o) == cfg.max_tokens for v in outs.values() for o in v),
        "wall_s": {n: round(v, 3) for n, v in wall.items()},
        "tokens_per_s": {n: round(v, 2) for n, v in tps.items()},
        "speedup_vs_hf_continuous_batching": ratio_cb,
        "speedup_vs_hf_generate": _ratio(tps.get("kvstrata"), tps.get("hf_generate")),
        "single_stream": single,
        "prefix_doc_tokens": prefix.doc_tokens if prefix is not None else None,
        "prefix_cold_ttft_s": median(prefix.cold_ttft_s) if prefix is not None else None,
        "prefix_hit_ttft_s": median(prefix.hit_ttft_s) if prefix is not None else None,
        "prefix_hit_ttft_ratio": prefix_ratio,
        "prefix_hit_ttft_eager_s": median(prefix_eager.hit_ttft_s) if prefix_eager is not None else None,
        "prefix_hit_ttft_ratio_eager": prefix_eager.ratio if prefix_eager is not None else None,
        "weight_bytes": wbytes, "hbm_bandwidth": cfg.hbm_bandwidth,
        "engine_features": {"prefill_graph_max_tokens": cfg.prefill_graph_max_tokens,
                            "fused_kernels": bool(cfg.fused_kernels)},
        "roofline_tokens_per_s": {"batch": round(roof_batch, 1), "single": round(1 / step_s, 1)},
        "roofline_fraction": {"batch": _ratio(tps.get("kvstrata"), roof_batch),
                              "single": None if decode is None else decode * step_s},
        "targets_met": {"kvstrata_ge_5x_continuous_batching": ratio_cb is not None and ratio_cb >= 5.0,
                        "single_stream_ge_100_tok_s": decode is not None and decode >= 100.0,
                        "prefix_hit_ttft_le_0.1x_cold": prefix_ratio is not None and prefix_ratio <= 0.1},
    }
    return r


def load_device_model(shape: str | None, model_path: str | None, device: torch.device, dtype: torch.dtype,
                      tokenizer_dir: str | None, seed: int) -> LoadedModel:
    """A checkpoint (``model_path``) or random weights of ``shape`` with the given tokenizer."""
    if model_path:
        return load_model(model_path, dtype=dtype, device=device)
    if tokenizer_dir is None:
        from bench.gpu_carry import activate
        from bench.gpu_carry import tokenizer_dir as carried

        try:
            activate()
            tokenizer_dir = str(carried())
        except FileNotFoundError:
            from cache_node.model_loader import resolve_model_dir

            tokenizer_dir = str(resolve_model_dir())
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return random_model(shape or "llama-3.1-8b", dtype, device, tok, seed)


def main_device(device_name: str, shape: str | None, model_path: str | None, quick: bool,
                hbm_bandwidth: float, overrides: dict[str, int], tokenizer_dir: str | None = None) -> dict[str, Any]:
    """Entry point of ``bench.engine`` when ``--device`` is not cpu or ``--model-shape`` is given."""
    import dataclasses

    device = resolve_device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fields = {f.name for f in dataclasses.fields(GpuBenchConfig)}
    cfg = dataclasses.replace(QUICK_GPU if quick else FULL_GPU, hbm_bandwidth=hbm_bandwidth,
                              **{k: v for k, v in overrides.items() if k in fields})
    lm = load_device_model(shape, model_path, device, dtype, tokenizer_dir, cfg.seed)
    assert lm.tokenizer is not None
    return run_device_bench(lm.tokenizer, lm, cfg, device, dtype, shape or "checkpoint", quick)
