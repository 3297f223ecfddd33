"""Per-instance fused kernels in a Llama model (cache_node.fused_layers): the patched model
computes what transformers' stock modules compute, only the patched instance changes, and the
engine patches only on CUDA with the triton backend and ``fused_kernels`` on.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET``);
the ``gpu``-marked test compares engines with fused kernels on and off on the device.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama import modeling_llama as llama

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.fused_layers import (
    apply_fused_kernels,
    fused_kernels_apply,
    is_patched,
    patch_model,
)
from cache_node.model_loader import module_identity
from cache_node.sampling_params import SamplingParams

STOCK = {cls: cls.forward for cls in (llama.LlamaRMSNorm, llama.LlamaMLP, llama.LlamaAttention)}
STOCK_ROPE = llama.apply_rotary_pos_emb


def _sdpa_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy that runs transformers' SDPA attention: the session's ``tiny`` model may have
    served an engine already, which set its attention to the engine's paged one (usable only
    inside an engine step: the suite failed here in that order, and passed alone)."""
    out = copy.deepcopy(model)
    out.config._attn_implementation = "sdpa"
    return out


def _patched_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    fused = _sdpa_copy(model)
    return fused, patch_model(fused)


def test_patched_tiny_llama_matches_stock_modules_and_model(tiny) -> None:
    """Every decoder module and the whole decoder (sdpa attention, 13 tokens) give the stock
    outputs; the stock classes and the rotary function stay transformers' own."""
    ref = _sdpa_copy(tiny.model)  # made before patching: the transformers peer
    fused, count = _patched_copy(tiny.model)
    layers = len(fused.model.layers)
    assert count == 4 * layers + 1  # 2 norms, MLP, attention per layer; the final norm
    ids = torch.randint(1, 500, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref.model(input_ids=ids, output_hidden_states=True)
        got = fused.model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=1e-5)
        x = want.hidden_states[1]
        cos, sin = ref.model.rotary_emb(x, torch.arange(13).unsqueeze(0))
        for a, b in zip(fused.model.layers, ref.model.layers):
            torch.testing.assert_close(a.input_layernorm(x), b.input_layernorm(x), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(a.mlp(x), b.mlp(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.self_attn(x, (cos, sin))[0], b.self_attn(x, (cos, sin))[0],
                                       atol=1e-5, rtol=1e-5)
    assert {cls: cls.forward for cls in STOCK} == STOCK and llama.apply_rotary_pos_emb is STOCK_ROPE


def test_patching_is_per_instance_and_keeps_weights(tiny) -> None:
    ref = copy.deepcopy(tiny.model)
    fused, _ = _patched_copy(tiny.model)
    assert is_patched(fused) and not is_patched(ref) and not is_patched(tiny.model)
    for module in ref.modules():  # the peer runs its class's forward
        assert "forward" not in module.__dict__ and not is_patched(module)
    for module in fused.modules():
        if type(module) in STOCK:
            assert is_patched(module) and "forward" in module.__dict__
    # the same state dict (names and values): the concatenated weights are non-persistent buffers
    config_json = tiny.model.config.to_json_string()
    assert module_identity("m", fused, config_json) == module_identity("m", ref, config_json)
    mlp, attn = fused.model.layers[0].mlp, fused.model.layers[0].self_attn
    # gate/up and q/k/v are views of the fused weights: one copy in memory
    assert mlp.gate_proj.weight.data_ptr() == mlp._kvstrata_gate_up_weight.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn._kvstrata_qkv_weight.untyped_storage().data_ptr()
    assert patch_model(fused) == 0  # idempotent


def test_weights_stay_one_copy_after_the_model_moves(tiny) -> None:
    """Review 21b F1: a ``.to()`` after patching converted the parameters and the fused buffer
    apart, so weights loaded afterwards (``load_state_dict`` copies into the parameters) never
    reached the fused GEMMs, which kept computing with the old ones."""
    fused = copy.deepcopy(_patched_copy(tiny.model)[0])  # a copy rebinds its own linears
    fused.to(torch.float16)
    ref = _sdpa_copy(tiny.model).to(torch.float16)
    with torch.no_grad():  # new weights, loaded after the move
        for p in ref.parameters():
            p.mul_(1.5).add_(0.01)
    fused.load_state_dict(ref.state_dict())
    mlp, attn = fused.model.layers[0].mlp, fused.model.layers[0].self_attn
    assert mlp._kvstrata_gate_up_weight.dtype == torch.float16
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp._kvstrata_gate_up_weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn._kvstrata_qkv_weight.untyped_storage().data_ptr()
    x = torch.randn(1, 9, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.float16)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), ref.model.layers[0].mlp(x), atol=2e-3, rtol=2e-3)
        ids = torch.randint(1, 500, (1, 9), generator=torch.Generator().manual_seed(1))
        want = ref.model(input_ids=ids).last_hidden_state
        got = fused.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_engine_with_patched_model_generates_stock_tokens(tiny) -> None:
    """Through the engine's paged attention (CPU, torch backend: prefill chunks, decodes, a
    prefix hit), a patched model's greedy tokens equal the stock model's."""
    prompts = [[(7 * i + 3) % 500 + 1 for i in range(n)] for n in (5, 37, 70)]
    prompts.append(prompts[2] + [11, 12, 13])  # a prefix hit on the 3rd prompt's blocks
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    cfg = EngineConfig(block_size=16, kv_pool_bytes=1 << 20, max_num_batched_tokens=32, max_num_seqs=4,
                       device="cpu")
    runs = []
    for fuse in (False, True):
        model = copy.deepcopy(tiny.model)
        if fuse:
            patch_model(model)
        eng = LLMEngine(model, cfg, tiny.model_id, tiny.eos_token_ids)
        assert eng.runner.fused_modules == 0  # the CPU engine itself patches nothing
        runs.append([o.output_token_ids for o in eng.generate(prompts, params)])
        eng.check_integrity()
    assert runs[0] == runs[1]


def test_cpu_engines_and_other_configs_are_untouched(tiny) -> None:
    eng = LLMEngine(copy.deepcopy(tiny.model), EngineConfig(device="cpu", kv_pool_bytes=1 << 20),
                    tiny.model_id, tiny.eos_token_ids)
    assert eng.runner.fused_modules == 0
    assert not any(is_patched(m) for m in eng.runner.model.modules())
    cuda = dataclasses.replace(EngineConfig(device="cpu").resolved(), device="cuda:0",
                               attention_backend="triton")
    assert fused_kernels_apply(cuda)
    assert not fused_kernels_apply(dataclasses.replace(cuda, fused_kernels=False))
    assert not fused_kernels_apply(dataclasses.replace(cuda, attention_backend="torch"))
    assert not fused_kernels_apply(EngineConfig(device="cpu", attention_backend="triton").resolved())
    model = copy.deepcopy(tiny.model)
    assert apply_fused_kernels(model, dataclasses.replace(cuda, fused_kernels=False)) == 0
    assert not is_patched(model)


def test_other_model_families_are_left_unpatched() -> None:
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config)
    assert patch_model(model) == 0
    assert not any(is_patched(m) for m in model.modules())


@pytest.mark.gpu
def test_engine_fused_on_and_off_give_the_same_greedy_tokens_cuda() -> None:
    """SmolLM2-135M shape, random weights, fp32 on CUDA with the triton backend (decode CUDA
    graphs on): fused kernels on and off give the same greedy tokens; the HF peer copied before
    the engine stays stock."""
    from cache_node.model_shapes import random_model

    lm = random_model("smollm2-135m", torch.float32, "cuda", seed=0)
    peer = copy.deepcopy(lm.model)
    prompts = [[(13 * i + 7 * n) % 49000 + 100 for i in range(n)] for n in (10, 60, 300)]
    prompts.append(prompts[2] + prompts[1][:40])  # a prefix hit
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = {}
    for fuse in (True, False):
        cfg = EngineConfig(device="cuda", dtype="float32", kv_pool_bytes=256 << 20, max_num_batched_tokens=256,
                           max_num_seqs=4, fused_kernels=fuse)
        eng = LLMEngine(copy.deepcopy(lm.model), cfg, lm.model_id, lm.eos_token_ids)
        assert (eng.runner.fused_modules > 0) == fuse
        eng.generate([prompts[2]], SamplingParams(max_tokens=2, ignore_eos=True))  # cache its blocks
        runs[fuse] = [o.output_token_ids for o in eng.generate(prompts, params)]
        eng.check_integrity()
    assert runs[True] == runs[False]
    assert not any(is_patched(m) for m in peer.modules())
