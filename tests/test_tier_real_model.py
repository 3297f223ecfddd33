"""Exactness on the real SmolLM2-135M and real Wikipedia text: restores from every tier are
token-identical to a never-demoted run."""

from __future__ import annotations

import pytest

from bench.tiers import corpus_prompt
from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.sampling_params import SamplingParams
from cache_node.tiers.manager import TierConfig
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillStore

pytestmark = pytest.mark.slow


def test_real_prompts_identical_after_device_host_spill_ram_disk_and_back(real_model, tmp_path) -> None:
    lm = real_model
    cfg = EngineConfig(block_size=16, kv_pool_bytes=128 << 20, max_num_batched_tokens=512)
    ref = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids)
    store = SpillStore(tmp_path, BlockFormat(*ref.spill_block_spec()), 256 << 20, 1 << 30)
    eng = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids,
                    tier_config=TierConfig(host_bytes=128 << 20), spill=store)
    params = SamplingParams(max_tokens=6)  # each decode step attends over the restored blocks
    prompts = [corpus_prompt(lm, 350, offset=5), corpus_prompt(lm, 170, offset=90)]  # 21 and 10 full blocks
    cold = [o.output_token_ids for o in ref.generate(prompts, params)]
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == cold
    for tier in ("device", "host", "spill_ram", "spill_disk"):
        if tier == "host":
            eng.demote_all()
        elif tier.startswith("spill"):
            eng.demote_all(to_spill=True)
            assert eng.wait_for_transfers()
            if tier == "spill_disk":
                assert store.demote_to_disk() > 0
        outs = eng.generate(prompts, params)
        for prompt, out, want in zip(prompts, outs, cold):
            assert out.output_token_ids == want, tier
            assert out.num_cached_tokens_by_tier[tier] == (len(prompt) - 1) // 16 * 16, tier
        eng.check_integrity()
