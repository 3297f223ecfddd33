"""Device selection end to end (issue 17): config validation and resolution, the model on its
device, per-step tensors on the pool's device, batched sampling, attention backends, and (GPU
machines only, ``-m gpu``) CUDA against CPU and transformers."""

from __future__ import annotations

import pytest
import torch

from cache_node.config import EngineConfig, resolve_device
from cache_node.model_shapes import MODEL_SHAPES, random_model, shape_config
from services.config import NodeConfig
from services.launcher import resolve_node_config

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:0", "", "mps"])
def test_a_malformed_device_is_refused_naming_the_field(bad: str) -> None:
    with pytest.raises(ValueError, match=r'device must be "auto", "cpu", "cuda" or "cuda:N"'):
        EngineConfig(device=bad)


def test_bad_dtype_and_backend_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="float64")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


def test_auto_resolves_to_this_machine() -> None:
    """auto = cuda when available, else cpu; dtype auto = bfloat16 on CUDA, float32 on CPU;
    backend auto = triton on CUDA, torch on CPU; explicit choices are kept."""
    cfg = EngineConfig().resolved()
    if CUDA:
        assert (cfg.device, cfg.dtype, cfg.attention_backend) == (
            f"cuda:{torch.cuda.current_device()}", "bfloat16", "triton")
    else:
        assert (cfg.device, cfg.dtype, cfg.attention_backend) == ("cpu", "float32", "torch")
    kept = EngineConfig(device="cpu", dtype="bfloat16", attention_backend="triton").resolved()
    assert (kept.device, kept.dtype, kept.attention_backend) == ("cpu", "bfloat16", "triton")
    assert kept.torch_device == torch.device("cpu") and kept.torch_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="not resolved"):
        _ = EngineConfig().torch_device


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False"):
        resolve_device("cuda:0")
    with pytest.raises(ValueError, match="is_available"):
        EngineConfig(device="cuda").resolved()


def test_node_config_device_and_launcher_resolution() -> None:
    """A node is "auto" | "cpu" | "cuda" (Ray picks the GPU); the launcher makes auto concrete
    from the cluster's GPU count, with bfloat16 as the CUDA default dtype."""
    with pytest.raises(ValueError, match="device must be one of"):
        NodeConfig(device="cuda:1")
    with pytest.raises(ValueError, match="dtype must be one of"):
        NodeConfig(dtype="int8")
    auto = NodeConfig()
    assert (resolve_node_config(auto, 0).device, resolve_node_config(auto, 0).dtype) == ("cpu", "float32")
    assert (resolve_node_config(auto, 8).device, resolve_node_config(auto, 8).dtype) == ("cuda", "bfloat16")
    fixed = NodeConfig(device="cpu", dtype="bfloat16")
    assert resolve_node_config(fixed, 8) == fixed


def test_random_model_shapes_match_the_published_configs() -> None:
    """Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab
    128256, rope theta 500000: 16.06 GB of bf16 weights (counted on the meta device)."""
    cfg = shape_config("llama-3.1-8b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) * 2 == 16_060_522_496
    with pytest.raises(ValueError, match="unknown model shape 'gpt2'; known"):
        shape_config("gpt2")
    assert sorted(MODEL_SHAPES) == ["llama-3.1-8b", "smollm2-135m"]


def test_random_model_is_built_on_its_device_in_its_dtype() -> None:
    lm = random_model(shape_config("smollm2-135m", num_hidden_layers=2), torch.bfloat16, "cpu", seed=3)
    assert {p.device.type for p in lm.model.parameters()} == {"cpu"}
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    assert lm.model_id == "random-llama-h576-l2@seed3:bfloat16:cpu"
    again = random_model(shape_config("smollm2-135m", num_hidden_layers=2), torch.bfloat16, "cpu", seed=3)
    assert torch.equal(lm.model.lm_head.weight, again.model.lm_head.weight)  # seeded
