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
    output (8 tokens) equals transformers ``generate``; the logits each prompt's first token is
    sampled from (its last prompt token's, after a prefill through the pool: chunked for the
    prompts past 128 tokens, over the cached prefix for the last) equal transformers' prefill
    logits within 1e-4."""
    tok = real_model.tokenizer
    prompts = _prompts(tok)
    assert [len(p) for p in prompts] == [*TARGETS, SHARED + 40]
    eng = make_engine(real_model, kv_pool_bytes=256 << 20, max_num_batched_tokens=128, max_num_seqs=8)
    first_logits: dict[str, torch.Tensor] = {}  # request id -> the row its first token is sampled from
    execute = eng.runner.execute

    def recorded(batch, *args, **kw):  # type: ignore[no-untyped-def]
        logits = execute(batch, *args, **kw)
        rows = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens]  # (execute's rows)
        assert len(rows) == logits.shape[0]
        for seq, row in zip(rows, logits):
            if not seq.output_token_ids:
                first_logits[seq.request_id] = row.clone()
        return logits

    eng.runner.execute = recorded  # type: ignore[method-assign]
    outs = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0, 0, SHARED]  # the one prefix hit
    assert len(first_logits) == len(prompts)
    ref = type(real_model.model).from_pretrained(real_model.model.name_or_path, dtype=torch.float32)
    ref.config._attn_implementation = "sdpa"
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # the mask given: else transformers infers one from the pad id
            gen = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=tok.pad_token_id,
                               output_logits=True, return_dict_in_generate=True)
        assert list(out.output_token_ids) == gen.sequences[0, len(prompt):].tolist()
        # transformers' prefill logits of the last prompt token
        assert (first_logits[out.request_id] - gen.logits[0][0]).abs().max().item() < 1e-4
