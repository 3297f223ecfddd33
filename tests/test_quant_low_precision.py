"""Quantized KV (HACK-style ``quant``, a scoring policy's ``cold_bits`` tier, SentenceKV's int8/int4
recall region) is attended on its codes in float32 whatever the pool's dtype.

Regression: ``QuantLayerKV.logits``/``output`` multiplied the step's queries (in the pool's
dtype) with the float32 codes, so under bfloat16 (the default dtype on CUDA) or float16 every
request of ``quant`` or of a ``cold_bits`` policy failed with "error" at its first step over
the codes ("expected scalar type Float but found BFloat16"), after one token, and so did every
SentenceKV session turn prefilled over its history's demoted sentences (its int8 recall region).
"""

from __future__ import annotations

import pytest
import torch

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import tiny_llama
from cache_node.policies.base import PolicyEnv
from cache_node.policies.quant import DEQUANT_MIN_ROWS, QuantLayerKV, pack_bits, quantize
from cache_node.sampling_params import SamplingParams
from cache_node.tiers.manager import TierConfig

LOW = (torch.bfloat16, torch.float16)


def layer_kv(num: int, h_kv: int, d: int, bits: int, group: int) -> QuantLayerKV:
    """One layer's codes of random K/V: (2, num, h_kv, d) quantized per group of ``group``."""
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn((2, num, h_kv, d), generator=gen)
    codes, scale, zero = quantize(kv, bits, group)
    return QuantLayerKV(pack_bits(codes, bits), scale, zero, bits)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize(("d", "group", "rows"), [
    (16, 16, 1),  # one group per head: the codes' single bmm
    (32, 8, 1),  # several groups: the einsum on the codes
    (32, 8, DEQUANT_MIN_ROWS),  # a long chunk: the keys/values dequantized once
])
def test_queries_of_any_dtype_attend_the_codes_as_float32_queries(dtype: torch.dtype, d: int, group: int,
                                                                  rows: int) -> None:
    """logits and output of a low-precision query are the float32 query's, computed in float32
    (the low-precision query's own values, so the same up to float32 rounding)."""
    h_kv, g, num = 2, 2, 24
    kv = layer_kv(num, h_kv, d, 8, group)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn((h_kv, g, rows, d), generator=gen).to(dtype)
    probs = torch.softmax(torch.randn((h_kv, g, rows, num), generator=gen), -1).to(dtype)
    want_logits, want_out = kv.logits(q.float(), 0.25), kv.output(probs.float())
    got_logits, got_out = kv.logits(q, 0.25), kv.output(probs)
    assert got_logits.dtype == torch.float32 and got_out.dtype == torch.float32
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("policy", ["quant", "quant-bits_4", "snapkv-0.5-cold_bits_4", "h2o-0.5-cold_bits_8"])
def test_a_quantizing_policy_decodes_to_its_end_in_low_precision(dtype: str, policy: str) -> None:
    """A 119-token prompt under each policy decodes all its 12 tokens (its layout moves tokens
    to the codes at the prompt's end, so every decode step attends them), no request failed."""
    lm = tiny_llama(seed=0)
    eng = LLMEngine(lm.model, EngineConfig(block_size=4, kv_pool_bytes=1 << 20, dtype=dtype), lm.model_id,
                    lm.eos_token_ids)
    out = eng.generate([list(range(1, 120))], SamplingParams(max_tokens=12, ignore_eos=True), policy=policy)[0]
    assert (out.finish_reason, len(out.output_token_ids)) == ("length", 12)
    assert eng.num_failed_requests == 0


def test_a_sentencekv_turn_over_its_int8_recall_region_runs_in_bfloat16() -> None:
    """A SentenceKV session's second turn continues from the first turn's state (its demoted
    sentences, recalled through the default int8 region) and prefills its 40 new tokens span by
    span over that region, then decodes: both turns end "length", none failed."""
    lm = tiny_llama(seed=0)
    eng = LLMEngine(lm.model, EngineConfig(block_size=4, kv_pool_bytes=1 << 20, dtype="bfloat16"), lm.model_id,
                    lm.eos_token_ids, tier_config=TierConfig(host_bytes=1 << 20))
    eng.policy_env = PolicyEnv(frozenset(range(0, 512, 9)))  # synthetic sentence ends
    turn = {"policy": "sentencekv-0.3", "session_id": "s", "tenant": "t"}
    first = eng.generate([[(7 * i) % 500 + 1 for i in range(200)]], SamplingParams(max_tokens=4, ignore_eos=True),
                         **turn)[0]
    history = eng.session_history("s")
    assert history is not None
    second = eng.generate([history + [(11 * i) % 500 + 1 for i in range(40)]],
                          SamplingParams(max_tokens=6, ignore_eos=True), **turn)[0]
    assert eng.sessions.num_policy_continuations == 1  # it ran over the kept state
    assert [first.finish_reason, second.finish_reason, len(second.output_token_ids)] == ["length", "length", 6]
    assert eng.num_failed_requests == 0
