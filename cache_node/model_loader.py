"""Model loading: any transformers checkpoint directory, SmolLM2-135M-Instruct by default.

Where checkpoints live, the default model's conversion and a checkpoint's identity are in
``cache_node.model_files``, which imports no torch or transformers (the gateway, the launcher
and the CLI use it); its names are re-exported here so existing imports keep working. This
module imports transformers' modeling code (~10 s on a loaded machine), so only a process that
builds a model should import it.

A loaded model's ``model_id`` (part of every block hash) is the checkpoint's identity
(``model_files.model_identity``: ``<dir name>@<digest>`` of config and weights) plus the
weight dtype, so two different checkpoints never share cached KV.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from cache_node.config import resolve_device
from cache_node.model_files import (  # noqa: F401 (re-exported: light callers' old imports)
    _GGUF_FILE,
    DEFAULT_MODEL,
    IDENTITY_FILE,
    _gguf_dir,
    cache_dir,
    convert_default_model,
    model_identity,
    resolve_model_dir,
)


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    model_id: str

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.config.eos_token_id
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))


def load_model(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load a causal LM and its tokenizer, weights straight onto ``device``.

    Args:
        path: a checkpoint directory (config.json + weights + tokenizer), or None for the
            default SmolLM2-135M-Instruct (converted and cached on first use).
        dtype: weight dtype.
        device: where the weights are loaded (accelerate's ``device_map``: each tensor is
            read from the checkpoint onto the device, never held whole on the CPU first);
            "auto"/"cuda"/"cuda:N"/"cpu" (``config.resolve_device``).

    Raises:
        FileNotFoundError: the directory or the default model package is missing.
        ValueError: the device does not exist here.
    """
    dev = resolve_device(str(device))
    path = resolve_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map=dev)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return LoadedModel(model.eval(), tokenizer, f"{model_identity(path)}:{_dtype_name(dtype)}")


def module_identity(name: str, model: torch.nn.Module, config_json: str) -> str:
    """``<name>@<32 hex>``: BLAKE2b-128 of a model built in code (config JSON and every tensor)."""
    digest = hashlib.blake2b(config_json.encode(), digest_size=16)
    for key, tensor in model.state_dict().items():
        digest.update(json.dumps([key, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return f"{name}@{digest.hexdigest()}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tiny_llama(seed: int = 0, num_layers: int = 2, vocab_size: int = 512) -> LoadedModel:
    """A tiny random Llama (GQA: 4 heads, 2 KV heads, head_dim 16) for unit tests.

    Its ``model_id`` digests the config and weights, so every seed and size is distinct.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=vocab_size - 1,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model, None, module_identity("tiny-llama", model, config.to_json_string()))
