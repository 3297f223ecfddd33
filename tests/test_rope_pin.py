"""RoPE that transformers recomputes per forward ("dynamic" NTK, "longrope") is fixed for the
node's whole context (``cache_node.rope_pin``), so a token's KV never depends on its step.

Regression: the engine runs every scheduled sequence in one forward, and those RoPE types took
their frequencies from the forward's longest sequence. A 24-token prompt computed alone and the
same prompt computed in a step with another tenant's 100-token prompt (past the model's
original 32 positions) got other keys for the same block hash: the prefix cache, the host tier
and the spill tier then served keys of other frequencies than a recompute, and a request's
tokens depended on who shared its steps.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.hashing import hash_prompt_blocks
from cache_node.model_loader import module_identity
from cache_node.sampling_params import SamplingParams

BS = 4
ROPES = {
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                 "long_factor": [4.0] * 8, "original_max_position_embeddings": 32},
}


def tiny_model(rope: str) -> tuple[LlamaForCausalLM, str]:
    """A tiny random Llama (head_dim 16) whose RoPE is ``ROPES[rope]``: its original context is
    32 positions ("dynamic": max_position_embeddings; "longrope": the original one)."""
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         max_position_embeddings=32 if rope == "dynamic" else 4096, rope_parameters=ROPES[rope])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return model, module_identity("tiny-rope", model, config.to_json_string())


def block_kv(eng: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """The cached KV of ``prompt``'s full blocks: (blocks, L, 2, BS, H_kv, d)."""
    hashes = hash_prompt_blocks(prompt, BS, ("default", eng.model_id, eng.kv_format))
    return eng.pool.read_blocks([eng.kv_manager.pool.cached[h].block_id for h in hashes])


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_a_blocks_kv_is_the_same_whatever_shares_its_step(rope: str) -> None:
    model, model_id = tiny_model(rope)
    cfg = EngineConfig(block_size=BS, kv_pool_bytes=1 << 20, max_model_len=128, max_num_batched_tokens=256)
    prompt, long = [(5 * i) % 500 + 1 for i in range(25)], [(3 * i) % 500 + 1 for i in range(100)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    alone = LLMEngine(model, cfg, model_id)
    alone.generate([prompt], params)
    shared = LLMEngine(model, cfg, model_id)
    shared.generate([long, prompt], params)  # one step computes both prompts
    assert shared.num_steps == 1
    a, b = block_kv(alone, prompt), block_kv(shared, prompt)
    assert torch.equal(a, b), f"the prompt's KV differs by up to {(a - b).abs().max().item():.3g}"


def test_the_pinned_context_is_part_of_the_model_identity() -> None:
    """Frequencies fixed for another max_model_len are other KV: another identity, so two such
    nodes never share a block hash; a RoPE that never varies leaves the identity as it was."""
    model, model_id = tiny_model("dynamic")
    ids = {n: LLMEngine(model, EngineConfig(block_size=BS, kv_pool_bytes=1 << 20, max_model_len=n), model_id).model_id
           for n in (64, 128)}
    assert ids == {64: f"{model_id}+rope=dynamic@64", 128: f"{model_id}+rope=dynamic@128"}
    again = LLMEngine(model, EngineConfig(block_size=BS, kv_pool_bytes=1 << 20, max_model_len=64), model_id)
    assert again.model_id == ids[64]  # the same model pinned again: the same identity
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    assert LLMEngine(plain, EngineConfig(block_size=BS, kv_pool_bytes=1 << 20), "plain").model_id == "plain"
