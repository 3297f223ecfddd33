"""Equivalence with transformers on the real SmolLM2-135M and real Wikipedia text."""

from __future__ import annotations

import pytest
import torch

from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine
from workloads.corpus import load_corpus

pytestmark = pytest.mark.slow


def _prompts(tok) -> list[list[int]]:
    arts = load_corpus()
    out = []
    for target in (10, 60, 150, 300, 500, 800, 1100, 1500):
        text, i = "", 0
        while len(tok(text).input_ids) < target:
            text += arts[(target + i) % len(arts)].extract + " "
            i += 1
        ids = tok(text).input_ids[: target - 1]
        out.append(ids + tok("\nIn short,").input_ids[:1])
    return out


def test_batch_matches_transformers_generate_and_prefill_logits(real_model) -> None:
    tok = real_model.tokenizer
    prompts = _prompts(tok)
    assert [len(p) for p in prompts] == [10, 60, 150, 300, 500, 800, 1100, 1500]
    eng = make_engine(real_model, kv_pool_bytes=256 << 20, max_num_batched_tokens=512, max_num_seqs=8)
    outs = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    ref = type(real_model.model).from_pretrained(real_model.model.name_or_path, dtype=torch.float32)
    ref.config._attn_implementation = "sdpa"
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=tok.pad_token_id)
        assert list(out.output_token_ids) == gen[0, len(prompt):].tolist()
    # prefill logits of the last prompt token, through the pool vs. a plain forward
    for prompt in (prompts[0], prompts[7]):
        eng2 = make_engine(real_model, kv_pool_bytes=128 << 20, max_num_batched_tokens=256)
        eng2.add_request(prompt, SamplingParams(max_tokens=1))
        while True:
            batch = eng2.scheduler.schedule()
            logits = eng2.runner.execute(batch)
            for seq, n in batch:
                seq.num_computed_tokens += n
            if logits.shape[0]:
                break
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0, -1]
        assert (logits[0] - want).abs().max().item() < 1e-4
