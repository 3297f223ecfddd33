"""Random-weight models of real shapes, built directly on a device (GPU benches and checks).

Where no weights can be fetched (an offline GPU machine), the throughput of a model depends
only on its shape: ``random_model("llama-3.1-8b", torch.bfloat16, "cuda")`` builds the 16 GB
Llama-3.1-8B shape on the GPU under a ``torch.device`` context, so no tensor is ever
materialised on the CPU. The configs are the published ``config.json`` values of
HuggingFaceTB/SmolLM2-135M and meta-llama/Llama-3.1-8B.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cache_node.config import resolve_device
from cache_node.model_loader import LoadedModel

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "llama-3.1-8b": {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
}


def shape_config(shape: str, **overrides: Any) -> LlamaConfig:
    """The ``LlamaConfig`` of a named shape (``MODEL_SHAPES``), ``overrides`` applied (e.g.
    ``num_hidden_layers=2`` for a cut-down check).

    Raises:
        ValueError: an unknown shape name (the message lists the known ones).
    """
    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {sorted(MODEL_SHAPES)}")
    return LlamaConfig(**{**MODEL_SHAPES[shape], **overrides})


def random_model(
    shape: str | LlamaConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "auto",
    seed: int = 0,
) -> LoadedModel:
    """A random-weight causal LM of ``shape`` (a ``MODEL_SHAPES`` name or a config), built on
    ``device`` in ``dtype`` without a CPU copy (transformers' default init, seeded by
    ``seed`` through ``torch.manual_seed``, which seeds the CUDA generators too).

    Its ``model_id`` names shape, seed, dtype and device type: the same seed draws different
    weights on CPU and CUDA (different generators), so the two never share cached KV.

    Raises:
        ValueError: an unknown shape name, or a device that does not exist here.
    """
    config = shape_config(shape) if isinstance(shape, str) else shape
    dev = resolve_device(str(device))
    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    name = shape if isinstance(shape, str) else f"llama-h{config.hidden_size}-l{config.num_hidden_layers}"
    dtype_name = str(dtype).removeprefix("torch.")
    return LoadedModel(model.eval(), None, f"random-{name}@seed{seed}:{dtype_name}:{dev.type}")
