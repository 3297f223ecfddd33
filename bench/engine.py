"""Engine benchmark: the kvstrata engine against transformers on one mixed Wikipedia chat workload.

Run ``python -m bench.engine [--quick]``. One process, one workload: the same chat-templated
token ids and the same ``max_tokens`` for every system, greedy, and every system stops at the
model's EOS (generated tokens are counted as each system returns them, EOS included):

(a) ``hf_generate`` — transformers ``model.generate``, one request at a time (SDPA attention);
(b) ``hf_continuous_batching`` — transformers' own continuous batching, ``model.generate_batch``
    with the "sdpa" attention implementation (continuous batching accepts only "sdpa",
    "paged|eager" or flash, and flash needs CUDA) and a cache sized to the workload;
(c) ``kvstrata`` — :class:`cache_node.engine.LLMEngine`, all requests submitted at once.

(a) and (b) share one copy of the weights; (c) has its own (the engine rewires its model's
attention). Each system serves one short warm-up request first. With ``--repeats`` > 1 the three
systems run interleaved (a, b, c, a, b, c, ...) and the median wall time of each is used:
``tokens_per_s`` = generated tokens / median wall seconds. CPU seconds are reported as well
(the machine is shared; CPU time is the less noisy of the two).

The shared-prefix case runs on the engine alone: a ~1k-token document followed by different
questions, each request submitted to an idle engine. The first request in a fresh cache
namespace is cold (its whole prompt is prefilled); the later ones hit the prefix cache.
``prefix_hit_ttft_ratio`` = median hit TTFT / median cold TTFT.

With ``--device cuda`` (or ``--model-shape``/``--model-path``) the bench runs on a device with
random weights of a real shape instead: ``bench.engine_gpu`` (its own workload, JSON and targets).

The systems and the prefix case live in ``bench.engine_systems``; this module builds the
workload, times the systems, and reports. The last stdout line is one JSON object (see
:func:`build_result`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from rich import progress as rp
from rich.console import Console
from rich.table import Table
from transformers import (
    ContinuousBatchingConfig,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from bench.common import (
    ChatRequest,
    chat_prompt,
    emit_json,
    median,
    shared_document,
    wiki_chat_requests,
)
from bench.engine_systems import (
    PREFIX_QUESTIONS,
    PrefixCase,
    cb_config,
    generation_config,
    load_reference_model,
    run_engine,
    run_hf_continuous_batching,
    run_hf_generate,
    run_prefix_case,
)
from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.kv_pool import KVPool
from cache_node.model_loader import LoadedModel, load_model
from workloads.corpus import load_corpus

HF_GENERATE = "hf_generate"
HF_CB = "hf_continuous_batching"
KVSTRATA = "kvstrata"
SYSTEMS = (HF_GENERATE, HF_CB, KVSTRATA)

T = TypeVar("T")
@dataclass(frozen=True)
class BenchConfig:
    """Sizes of one benchmark run.

    Attributes:
        num_requests, max_tokens: the throughput workload (every system gets the same).
        min_words, max_words: word budget of each article extract in a prompt.
        repeats: interleaved passes of the three systems; medians are reported.
        prefix_doc_tokens: length of the shared document (tokens, at least).
        prefix_rounds: fresh cache namespaces, each with one cold request ...
        prefix_hits_per_round: ... followed by this many prefix-hit requests.
        prefix_max_tokens: tokens generated per prefix-case request (only TTFT is measured).
        max_num_batched_tokens: the engine's per-step token budget; transformers' continuous
            batching gets the same ``max_batch_tokens``.
        threads: torch intra-op threads for every system (the bench runs them in one process).
    """

    num_requests: int = 32
    max_tokens: int = 64
    min_words: int = 30
    max_words: int = 160
    repeats: int = 1
    seed: int = 0
    prefix_doc_tokens: int = 1024
    prefix_rounds: int = 3
    prefix_hits_per_round: int = 4
    prefix_max_tokens: int = 4
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("num_requests", "max_tokens", "min_words", "repeats", "prefix_rounds",
                     "prefix_hits_per_round", "prefix_max_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_words < self.min_words:
            raise ValueError(f"max_words ({self.max_words}) < min_words ({self.min_words})")
        if self.prefix_hits_per_round >= len(PREFIX_QUESTIONS):
            raise ValueError(f"prefix_hits_per_round must be < {len(PREFIX_QUESTIONS)}")


FULL = BenchConfig()
QUICK = BenchConfig(num_requests=20, max_tokens=32, min_words=15, max_words=80, prefix_rounds=1,
                    prefix_hits_per_round=3)


@dataclass
class SystemRun:
    """One system's passes over the workload: generated ids per request, wall and CPU seconds."""

    name: str
    outputs: list[list[int]] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / median(self.wall_s)


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """``(fn(), wall seconds, CPU seconds of this process)``."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def make_engine(lm: LoadedModel, prompts: Sequence[Sequence[int]], cfg: BenchConfig) -> LLMEngine:
    """An engine whose pool holds the whole workload at once (no preemption), plus the prefix case."""
    mc = lm.model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    per_token = KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, torch.float32)
    tokens = sum(len(p) + cfg.max_tokens + cfg.block_size for p in prompts)
    tokens = max(tokens, 2 * (cfg.prefix_doc_tokens + 256))
    config = EngineConfig(
        block_size=cfg.block_size,
        kv_pool_bytes=int(tokens * per_token * 1.25),
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=max(cfg.num_requests, 8),
    )
    return LLMEngine(lm.model, config, lm.model_id, lm.eos_token_ids)


# ---- setup and reporting ----------------------------------------------------------------------------
def greedy_match(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> float:
    """Fraction of requests whose generated ids are identical to the reference's.

    Raises:
        ValueError: the two lists differ in length or are empty.
    """
    if len(reference) != len(candidate) or not reference:
        raise ValueError("greedy_match needs two equally long, non-empty lists of outputs")
    return sum(list(a) == list(b) for a, b in zip(reference, candidate)) / len(reference)


def build_result(runs: dict[str, SystemRun], prefix: PrefixCase, requests: Sequence[ChatRequest],
                 cfg: BenchConfig, quick: bool) -> dict[str, Any]:
    """The JSON result: throughput per system, speedups, prefix-hit TTFT ratio, greedy match."""
    tps = {name: run.tokens_per_s for name, run in runs.items()}
    ref = runs[HF_GENERATE].outputs
    plens = [len(r.prompt_token_ids) for r in requests]
    return {
        "bench": "engine",
        "quick": quick,
        "num_requests": len(requests),
        "max_tokens": cfg.max_tokens,
        "repeats": cfg.repeats,
        "prompt_tokens": {"min": min(plens), "median": median(plens), "max": max(plens), "total": sum(plens)},
        "generated_tokens": {n: r.num_generated_tokens for n, r in runs.items()},
        "wall_s": {n: round(median(r.wall_s), 3) for n, r in runs.items()},
        "cpu_s": {n: round(median(r.cpu_s), 3) for n, r in runs.items()},
        "tokens_per_s": {n: round(v, 2) for n, v in tps.items()},
        "speedup_vs_hf_generate": round(tps[KVSTRATA] / tps[HF_GENERATE], 3),
        "speedup_vs_hf_continuous_batching": round(tps[KVSTRATA] / tps[HF_CB], 3),
        "cpu_speedup_vs_hf_continuous_batching": round(
            median(runs[HF_CB].cpu_s) / median(runs[KVSTRATA].cpu_s), 3),
        "greedy_match": greedy_match(ref, runs[KVSTRATA].outputs),
        "greedy_match_hf_continuous_batching": greedy_match(ref, runs[HF_CB].outputs),
        "prefix_doc_tokens": prefix.doc_tokens,
        "prefix_cold_ttft_s": round(median(prefix.cold_ttft_s), 4),
        "prefix_hit_ttft_s": round(median(prefix.hit_ttft_s), 4),
        "prefix_hit_cached_tokens": min(prefix.hit_cached_tokens),
        "prefix_hit_ttft_ratio": round(prefix.ratio, 4),
        "engine_config": {"block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens},
        "torch_threads": torch.get_num_threads(),
    }


def print_table(console: Console, result: dict[str, Any]) -> None:
    """The human-readable summary (the JSON line follows it)."""
    table = Table(title=f"engine bench: {result['num_requests']} chat requests, "
                        f"max_tokens={result['max_tokens']}, {result['prompt_tokens']['total']} prompt tokens")
    for col in ("system", "gen tokens", "wall s", "cpu s", "tokens/s", "kvstrata speedup"):
        table.add_column(col, justify="left" if col == "system" else "right")
    kv = result["tokens_per_s"][KVSTRATA]
    for name in SYSTEMS:
        tps = result["tokens_per_s"][name]
        table.add_row(name, str(result["generated_tokens"][name]), f"{result['wall_s'][name]:.1f}",
                      f"{result['cpu_s'][name]:.1f}", f"{tps:.1f}", f"{kv / tps:.2f}x")
    console.print(table)
    console.print(
        f"shared prefix ({result['prefix_doc_tokens']} doc tokens): cold TTFT "
        f"{result['prefix_cold_ttft_s'] * 1000:.0f} ms, hit TTFT {result['prefix_hit_ttft_s'] * 1000:.0f} ms "
        f"(ratio {result['prefix_hit_ttft_ratio']:.3f}); greedy match vs hf_generate "
        f"{result['greedy_match']:.3f}"
    )


# ---- main ---------------------------------------------------------------------------------
def _progress(console: Console) -> rp.Progress:
    return rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
                       rp.TimeElapsedColumn(), console=console, transient=True)


def _pass_calls(ref: PreTrainedModel, engine: LLMEngine, prompts: list[list[int]], gen: GenerationConfig,
                cbc: ContinuousBatchingConfig, cfg: BenchConfig, progress: rp.Progress,
                rep: int) -> dict[str, tuple[Callable[[], list[list[int]]], rp.TaskID]]:
    """One pass's three calls, each with its progress task."""
    tag = f"[{rep + 1}/{cfg.repeats}]"
    tasks = {n: progress.add_task(f"{tag} {n}", total=None if n == HF_CB else len(prompts)) for n in SYSTEMS}
    return {
        HF_GENERATE: (partial(run_hf_generate, ref, prompts, gen, partial(progress.advance, tasks[HF_GENERATE])),
                      tasks[HF_GENERATE]),
        HF_CB: (partial(run_hf_continuous_batching, ref, prompts, gen, cbc), tasks[HF_CB]),
        KVSTRATA: (partial(run_engine, engine, prompts, cfg.max_tokens, partial(progress.advance, tasks[KVSTRATA]),
                           f"bench-{rep}"), tasks[KVSTRATA]),
    }


def _run_systems(lm: LoadedModel, tok: PreTrainedTokenizerBase, ref: PreTrainedModel, engine: LLMEngine,
                 prompts: list[list[int]], cfg: BenchConfig, progress: rp.Progress) -> dict[str, SystemRun]:
    """Warm up, then run (a), (b), (c) interleaved ``cfg.repeats`` times."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else lm.eos_token_ids[0]
    gen = generation_config(cfg.max_tokens, lm.eos_token_ids, pad)
    cbc = cb_config(prompts, cfg.max_tokens, cfg.max_num_batched_tokens)
    warm, warm_gen = [chat_prompt(tok, "Say hello.")], generation_config(4, lm.eos_token_ids, pad)
    run_hf_generate(ref, warm, warm_gen)
    run_hf_continuous_batching(ref, warm, warm_gen, cbc)
    run_engine(engine, warm, 4, cache_namespace="bench-warmup")
    runs = {name: SystemRun(name) for name in SYSTEMS}
    for rep in range(cfg.repeats):
        for name, (call, task) in _pass_calls(ref, engine, prompts, gen, cbc, cfg, progress, rep).items():
            outs, wall_s, cpu_s = timed(call)
            progress.update(task, total=len(prompts), completed=len(prompts))
            run = runs[name]
            run.outputs = outs
            run.wall_s.append(wall_s)
            run.cpu_s.append(cpu_s)
    return runs


def run_bench(lm: LoadedModel, ref: PreTrainedModel, cfg: BenchConfig, quick: bool, err: Console) -> dict[str, Any]:
    """Build the workload, run the three systems and the prefix case; return the JSON result.

    Raises:
        ValueError: ``lm`` has no tokenizer (the workload needs its chat template).
    """
    tok = lm.tokenizer
    if tok is None:
        raise ValueError(f"model {lm.model_id!r} has no tokenizer; the bench needs its chat template")
    corpus = load_corpus()
    requests = wiki_chat_requests(tok, corpus, cfg.num_requests, seed=cfg.seed,
                                  min_words=cfg.min_words, max_words=cfg.max_words)
    prompts = [list(r.prompt_token_ids) for r in requests]
    engine = make_engine(lm, prompts, cfg)
    with _progress(err) as progress:
        runs = _run_systems(lm, tok, ref, engine, prompts, cfg, progress)
        task = progress.add_task("shared-prefix TTFT (kvstrata)",
                                 total=cfg.prefix_rounds * (1 + cfg.prefix_hits_per_round))
        doc = shared_document(tok, corpus, cfg.prefix_doc_tokens, seed=cfg.seed + 1)
        prefix = run_prefix_case(engine, tok, doc, cfg.prefix_rounds, cfg.prefix_hits_per_round,
                                 cfg.prefix_max_tokens, lambda: progress.advance(task))
    engine.check_integrity()
    return build_result(runs, prefix, requests, cfg, quick)


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, bool, argparse.Namespace]:
    """The CPU bench's config, ``--quick``, and every parsed argument (the device options)."""
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cpu",
                   help="cpu (this bench, the real SmolLM2) or cuda[:i]/auto (bench.engine_gpu)")
    p.add_argument("--model-shape", default=None, choices=["llama-3.1-8b", "smollm2-135m", "tiny"],
                   help="random weights of this shape (device mode; default llama-3.1-8b)")
    p.add_argument("--model-path", default=None, help="a checkpoint directory instead of random weights")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer dir for random weights "
                   "(default: the GPU carry folder, else the converted SmolLM2)")
    p.add_argument("--hbm-bandwidth", type=float, default=4.8e12, help="bytes/s for the decode roofline")
    for name in ("min_prompt_tokens", "max_prompt_tokens", "hf_generate_requests"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    p.add_argument("--prefill-graph-max-tokens", type=int, dest="prefill_graph_max_tokens",
                   help="device mode: the engine's largest prefill graph (0: none; default 256)")
    p.add_argument("--fused-kernels", type=int, choices=[0, 1], dest="fused_kernels",
                   help="device mode: fused Triton RMSNorm/SiLU/RoPE on CUDA (default 1)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK.num_requests} requests, max_tokens {QUICK.max_tokens} (about 3 minutes)")
    for name in ("num_requests", "max_tokens", "min_words", "max_words", "repeats", "max_num_batched_tokens",
                 "threads", "seed", "prefix_doc_tokens", "prefix_rounds", "prefix_hits_per_round"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    a = p.parse_args(argv)
    base = QUICK if a.quick else FULL
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    over = {k: v for k, v in vars(a).items() if k in fields and v is not None}
    return dataclasses.replace(base, **over), a.quick, a


def main(argv: Sequence[str] | None = None) -> None:
    cfg, quick, args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    if args.device != "cpu" or args.model_shape or args.model_path:
        from bench.engine_gpu import main_device

        over = {k: v for k, v in vars(args).items() if isinstance(v, int) and not isinstance(v, bool)}
        emit_json(main_device(args.device, args.model_shape, args.model_path, quick, args.hbm_bandwidth,
                              over, args.tokenizer_path))
        return
    torch.set_num_threads(cfg.threads)
    out, err = Console(), Console(stderr=True)
    lm = load_model()
    ref = load_reference_model(lm)
    result = run_bench(lm, ref, cfg, quick, err)
    print_table(out, result)
    emit_json(result)


if __name__ == "__main__":
    main()
