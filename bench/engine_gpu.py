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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.common import chat_prompt, median, shared_document
from bench.engine_systems import (
    cb_config,
    generation_config,
    run_engine,
    run_hf_continuous_batching,
    run_hf_generate,
    run_prefix_case,
)
from cache_node.config import EngineConfig, resolve_device
from cache_node.engine import LLMEngine
from cache_node.kv_pool import KVPool
from cache_node.model_loader import LoadedModel, load_model
from cache_node.model_shapes import MODEL_SHAPES, shape_config
from cache_node.model_shapes import random_model as shapes_random_model
from cache_node.sampling_params import SamplingParams
from workloads.corpus import Article, load_corpus

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
                          dtype=str(dtype).removeprefix("torch."))
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


def _single_stream(engine: LLMEngine, prompt: list[int], max_tokens: int, device: torch.device) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    [out], wall = _timed(device, lambda: engine.generate([prompt], params, cache_namespace="single-stream"))
    ttft = out.ttft_s or 0.0
    n = len(out.output_token_ids)
    return {"prompt_tokens": len(prompt), "ttft_s": round(ttft, 4), "wall_s": round(wall, 4),
            "decode_tokens_per_s": round((n - 1) / max(wall - ttft, 1e-9), 2)}


def run_device_bench(tok: PreTrainedTokenizerBase, lm: LoadedModel, cfg: GpuBenchConfig, device: torch.device,
                     dtype: torch.dtype, shape: str, quick: bool) -> dict[str, Any]:
    """The three systems, the single stream and the prefix case; the JSON result."""
    corpus = load_corpus()
    prompts = sized_prompts(tok, corpus, cfg.num_requests, cfg.min_prompt_tokens, cfg.max_prompt_tokens, cfg.seed)
    ref = copy.deepcopy(lm.model)
    if hasattr(ref, "set_attn_implementation"):
        ref.set_attn_implementation("sdpa")
    # no EOS anywhere transformers could fill it in from (its defaults merge into ours)
    ref.config.eos_token_id = ref.generation_config.eos_token_id = None
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    gen = generation_config(cfg.max_tokens, [], pad)
    gen.eos_token_id = None  # random weights: never stop early
    cbc = cb_config(prompts, cfg.max_tokens, cfg.max_num_batched_tokens)
    warm = prompts[:1]
    warm_gen = generation_config(4, [], pad)
    warm_gen.eos_token_id = None
    run_hf_generate(ref, warm, warm_gen)
    run_hf_continuous_batching(ref, warm, warm_gen, cbc)
    engine = _engine(lm, prompts, cfg, device, dtype)
    run_engine(engine, warm, 4, cache_namespace="warmup", ignore_eos=True)
    hf_prompts = prompts[: cfg.hf_generate_requests]
    outs: dict[str, list[list[int]]] = {}
    wall: dict[str, float] = {}
    outs["hf_generate"], wall["hf_generate"] = _timed(device, lambda: run_hf_generate(ref, hf_prompts, gen))
    outs["hf_continuous_batching"], wall["hf_continuous_batching"] = _timed(
        device, lambda: run_hf_continuous_batching(ref, prompts, gen, cbc))
    outs["kvstrata"], wall["kvstrata"] = _timed(
        device, lambda: run_engine(engine, prompts, cfg.max_tokens, cache_namespace="bench", ignore_eos=True))
    single = _single_stream(engine, prompts[-1], cfg.max_tokens, device)
    doc = shared_document(tok, corpus, cfg.prefix_doc_tokens, seed=cfg.seed + 1)
    prefix = run_prefix_case(engine, tok, doc, cfg.prefix_rounds, cfg.prefix_hits_per_round, 1)
    engine.wait_for_transfers()
    engine.check_integrity()
    return device_result(outs, wall, prompts, single, prefix.cold_ttft_s, prefix.hit_ttft_s, prefix.doc_tokens,
                         weight_bytes(lm.model), cfg, shape, str(dtype).removeprefix("torch."), quick)


def device_result(outs: dict[str, list[list[int]]], wall: dict[str, float], prompts: Sequence[Sequence[int]],
                  single: dict[str, float], cold: Sequence[float], hit: Sequence[float], doc_tokens: int,
                  wbytes: int, cfg: GpuBenchConfig, shape: str, dtype: str, quick: bool) -> dict[str, Any]:
    """The JSON result of a device run (pure: tested on the CPU)."""
    tps = {n: sum(len(o) for o in outs[n]) / wall[n] for n in outs}
    step_s = wbytes / cfg.hbm_bandwidth
    roof_batch = cfg.num_requests / step_s
    ratio_cb = tps["kvstrata"] / tps["hf_continuous_batching"]
    prefix_ratio = median(hit) / median(cold)
    plens = [len(p) for p in prompts]
    return {
        "bench": "engine", "mode": "device", "quick": quick, "model_shape": shape, "dtype": dtype,
        "num_requests": len(prompts), "max_tokens": cfg.max_tokens,
        "prompt_tokens": {"min": min(plens), "median": median(plens), "max": max(plens), "total": sum(plens)},
        "hf_generate_requests": len(outs["hf_generate"]),
        "generated_tokens": {n: sum(len(o) for o in v) for n, v in outs.items()},
        "all_full_length": all(len(o) == cfg.max_tokens for v in outs.values() for o in v),
        "wall_s": {n: round(v, 3) for n, v in wall.items()},
        "tokens_per_s": {n: round(v, 2) for n, v in tps.items()},
        "speedup_vs_hf_continuous_batching": round(ratio_cb, 3),
        "speedup_vs_hf_generate": round(tps["kvstrata"] / tps["hf_generate"], 3),
        "single_stream": single,
        "prefix_doc_tokens": doc_tokens,
        "prefix_cold_ttft_s": round(median(cold), 4), "prefix_hit_ttft_s": round(median(hit), 4),
        "prefix_hit_ttft_ratio": round(prefix_ratio, 4),
        "weight_bytes": wbytes, "hbm_bandwidth": cfg.hbm_bandwidth,
        "roofline_tokens_per_s": {"batch": round(roof_batch, 1), "single": round(1 / step_s, 1)},
        "roofline_fraction": {"batch": round(tps["kvstrata"] / roof_batch, 6),
                              "single": round(single["decode_tokens_per_s"] * step_s, 6)},
        "targets_met": {"kvstrata_ge_5x_continuous_batching": ratio_cb >= 5.0,
                        "single_stream_ge_100_tok_s": single["decode_tokens_per_s"] >= 100.0,
                        "prefix_hit_ttft_le_0.1x_cold": prefix_ratio <= 0.1},
    }


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
