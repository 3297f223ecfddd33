"""The systems the engine benchmark compares, and its shared-prefix case.

(a) transformers ``generate`` one request at a time, (b) transformers' continuous batching
(``generate_batch``), (c) the kvstrata engine; each takes token-id prompts and returns the generated
ids per prompt (EOS included), in prompt order. See ``bench.engine`` for how they are timed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    PreTrainedModel,
)

from bench.common import chat_prompt, median
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams

Advance = Callable[[], None]


def _noop() -> None:
    return None


PREFIX_QUESTIONS = (
    "Which of the subjects above is the oldest? Answer in one sentence.",
    "Name two places mentioned in the text above.",
    "What is the main topic of the first section?",
    "List three people named in the text above.",
    "Which section above mentions a war, if any?",
    "Give a one-line title that covers the whole text.",
    "What numbers or dates appear in the last section?",
    "Which section would a geographer find most useful?",
)


@dataclass(frozen=True)
class PrefixCase:
    """Shared-prefix TTFTs (seconds) measured on the engine."""

    doc_tokens: int
    cold_ttft_s: list[float]
    hit_ttft_s: list[float]
    hit_cached_tokens: list[int]

    @property
    def ratio(self) -> float:
        return median(self.hit_ttft_s) / median(self.cold_ttft_s)


def generation_config(max_tokens: int, eos_token_ids: Sequence[int], pad_token_id: int) -> GenerationConfig:
    """Greedy, ``max_tokens`` new tokens, stop at any of ``eos_token_ids``."""
    return GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, eos_token_id=list(eos_token_ids),
        pad_token_id=pad_token_id, temperature=None, top_p=None, top_k=None,
    )


@torch.inference_mode()
def run_hf_generate(model: PreTrainedModel, prompts: Sequence[Sequence[int]], gen: GenerationConfig,
                    advance: Advance = _noop) -> list[list[int]]:
    """(a) ``model.generate`` one request at a time; generated ids per prompt (EOS included)."""
    out = []
    for p in prompts:
        ids = torch.tensor([list(p)], dtype=torch.long, device=model.device)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)  # type: ignore[operator]
        out.append(seq[0, len(p):].tolist())
        advance()
    return out


def cb_config(prompts: Sequence[Sequence[int]], max_tokens: int, max_batch_tokens: int) -> ContinuousBatchingConfig:
    """transformers continuous batching sized to the workload.

    Without ``num_blocks`` it sizes its cache from free host memory (~20 GB here: ~24 s of
    zero-filling per ``generate_batch`` call); ``max_batch_tokens`` matches the engine's budget
    (a sweep of 256-2048 and page sizes 16-256 moved its CPU time by < 10%). The page size is
    ``page_size`` from transformers 5.2x, ``block_size`` before (5.17 on the acceptance GPU).
    """
    default = ContinuousBatchingConfig()
    page = int(getattr(default, "page_size", None) or default.block_size)
    tokens = sum(len(p) + max_tokens for p in prompts)
    return ContinuousBatchingConfig(num_blocks=math.ceil(tokens / page) + len(prompts) + 2,
                                    max_batch_tokens=max_batch_tokens)


def run_hf_continuous_batching(model: PreTrainedModel, prompts: Sequence[Sequence[int]],
                               gen: GenerationConfig, config: ContinuousBatchingConfig) -> list[list[int]]:
    """(b) transformers' continuous batching, ``model.generate_batch``; ids in prompt order.

    Raises:
        RuntimeError: a request came back missing or failed.
    """
    results = model.generate_batch(  # type: ignore[operator]
        inputs=[list(p) for p in prompts], generation_config=gen, continuous_batching_config=config,
        progress_bar=False,
    )
    ordered = list(results.values())
    if len(ordered) != len(prompts) or any(r.error for r in ordered):
        raise RuntimeError(f"generate_batch returned {len(ordered)}/{len(prompts)} results or errors")
    return [list(r.generated_tokens) for r in ordered]


def run_engine(engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int,
               advance: Advance = _noop, cache_namespace: str | None = None,
               ignore_eos: bool = False) -> list[list[int]]:
    """(c) the kvstrata engine: submit everything, step until all finish; ids in prompt order.
    ``ignore_eos``: every request generates ``max_tokens`` (random-weight device runs)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    ids = [engine.add_request(p, params, cache_namespace=cache_namespace) for p in prompts]
    final: dict[str, list[int]] = {}
    while len(final) < len(ids):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.output_token_ids)
                advance()
    return [final[i] for i in ids]


def run_prefix_case(engine: LLMEngine, tokenizer: Any, document: str, rounds: int, hits_per_round: int,
                    max_tokens: int, advance: Advance = _noop) -> PrefixCase:
    """Cold vs prefix-hit TTFT: per round, a fresh cache namespace, then 1 cold + N hit requests.

    Each request runs alone on an idle engine, so its TTFT is its prefill plus one sampled token.
    """
    cold: list[float] = []
    hit: list[float] = []
    cached: list[int] = []
    params = SamplingParams(max_tokens=max_tokens)
    for r in range(rounds):
        namespace = f"bench-prefix-{r}-{time.monotonic_ns()}"
        questions = PREFIX_QUESTIONS[r:] + PREFIX_QUESTIONS[:r]
        for i, question in enumerate(questions[: 1 + hits_per_round]):
            prompt = chat_prompt(tokenizer, f"{document}\n\nQuestion: {question}")
            [out] = engine.generate([prompt], params, cache_namespace=namespace)
            if out.ttft_s is None:
                raise RuntimeError(f"prefix-case request {out.request_id} produced no token")
            (cold if i == 0 else hit).append(out.ttft_s)
            if i:
                cached.append(out.num_cached_tokens)
            advance()
    doc_tokens = len(tokenizer.encode(document, add_special_tokens=False))
    return PrefixCase(doc_tokens, cold, hit, cached)


def load_reference_model(lm: LoadedModel) -> PreTrainedModel:
    """A second copy of the weights with transformers' SDPA attention (the engine rewires its own)."""
    path = str(lm.model.name_or_path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
