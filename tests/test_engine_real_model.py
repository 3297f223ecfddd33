"""Equivalence with transformers on the real SmolLM2-135M and real Wikipedia text."""

from __future__ import annotations

import pytest
import torch

from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine
from workloads.corpus import load_corpus

pytestmark = pytest.mark.slow

TARGETS = (10, 60, 150, 300, 600)
SHARED = 240  # tokens (15 blocks of 16) the last prompt shares with the 300-token one


def _prompts(tok) -> list[list[int]]:
    arts = load_corpus()
    out = []
    for target in TARGETS:
        text, i = "", 0
        while len(tok(text).input_ids) < target:
            text += arts[(target + i) % len(arts)].extract + " "
            i += 1
        ids = tok(text).input_ids[: target - 1]
        out.append(ids + tok("\nIn short,").input_ids[:1])
    # the 300-token prompt's first 240 tokens with another ending: a prefix-cache hit
    out.append(out[3][:SHARED] + out[1][:40])
    return out


def test_batch_matches_transformers_generate_and_prefill_logits(real_model) -> None:
    """Six prompts (10..600 tokens of Wikipedia text) run as one batch through the engine with a
    128-token step budget, so chunked prefills share steps with other sequences' decodes, and
    the last prompt reuses 240 tokens of the 300-token one from the prefix cache. Each greedy
    output (8 tokens) equals transformers ``generate``; the last prompt token's logits after a
    chunked prefill through the pool equal transformers' prefill logits within 1e-4."""
    tok = real_model.tokenizer
    prompts = _prompts(tok)
    assert [len(p) for p in prompts] == [*TARGETS, SHARED + 40]
    eng = make_engine(real_model, kv_pool_bytes=256 << 20, max_num_batched_tokens=128, max_num_seqs=8)
    outs = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0, 0, SHARED]  # the one prefix hit
    ref = type(real_model.model).from_pretrained(real_model.model.name_or_path, dtype=torch.float32)
    ref.config._attn_implementation = "sdpa"
    want_logits = {}
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # the mask given: else transformers infers one from the pad id
            gen = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=tok.pad_token_id,
                               output_logits=True, return_dict_in_generate=True)
        assert list(out.output_token_ids) == gen.sequences[0, len(prompt):].tolist()
        want_logits[i] = gen.logits[0][0]  # transformers' prefill logits of the last prompt token
    # prefill logits of the last prompt token, through the pool (chunked for the long one)
    for i in (0, 4):
        eng2 = make_engine(real_model, kv_pool_bytes=128 << 20, max_num_batched_tokens=256)
        eng2.add_request(prompts[i], SamplingParams(max_tokens=1))
        while True:
            batch = eng2.scheduler.schedule()
            logits = eng2.runner.execute(batch)
            for seq, n in batch:
                seq.num_computed_tokens += n
            if logits.shape[0]:
                break
        assert (logits[0] - want_logits[i]).abs().max().item() < 1e-4
