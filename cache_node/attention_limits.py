"""Attention variants of a checkpoint that the paged attention does not compute, found at load.

The engine's attention (``cache_node.attention``) is causal attention over every earlier token.
transformers hands a layer's variants to it as keyword arguments it does not read: a sliding
window (Mistral's and Phi-3's ``sliding_window``, Qwen2's sliding layers), logit soft-capping
(Gemma2) or attention sinks (gpt-oss). Ignored, each would compute other KV and tokens than the
model, silently. So a context is kept within the narrowest sliding window (inside it, windowed
and full attention are the same), and the other variants are refused.

Which layers slide is read from what each layer hands the attention function in one 1-token
forward (``attention_keywords``), not from attribute names: Phi-3's attention has no ``q_proj``
and reads the window from its config, while a Llama whose config.json carries a stray
``sliding_window`` never slides.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import AttentionInterface

PROBE_IMPLEMENTATION = "kvstrata_probe"
_probe = threading.local()  # .layers: layer index -> the keywords it handed the attention function


def _record_keywords(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``attention_keywords``' attention function: records the layer's keywords; zeros
    (batch, tokens, heads, head_dim) for ``query`` (batch, heads, tokens, head_dim)."""
    _probe.layers[getattr(module, "layer_idx", id(module))] = kwargs
    return torch.zeros_like(query).transpose(1, 2), None


AttentionInterface.register(PROBE_IMPLEMENTATION, _record_keywords)


def attention_keywords(model: torch.nn.Module) -> dict[int, dict[str, Any]]:
    """Layer index -> the keyword arguments that layer hands transformers' attention function
    (``sliding_window``, ``softcap``, ``s_aux``, ...), from one 1-token forward of ``model``
    (no cache, no grad; its attention implementation is restored after)."""
    config = model.config
    implementation = config._attn_implementation
    _probe.layers = {}
    device = model.get_input_embeddings().weight.device
    try:
        config._attn_implementation = PROBE_IMPLEMENTATION
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
        return _probe.layers
    finally:
        config._attn_implementation = implementation
        _probe.layers = {}


def sliding_window(layers: dict[int, dict[str, Any]]) -> int | None:
    """The narrowest sliding window (tokens) any layer of ``layers`` (``attention_keywords``)
    hands the attention function, None when none does (full attention everywhere)."""
    windows = [w for kw in layers.values() if isinstance(w := kw.get("sliding_window"), int) and w > 0]
    return min(windows, default=None)


def check_attention_variants(model: torch.nn.Module, layers: dict[int, dict[str, Any]]) -> None:
    """Raise ValueError naming a variant of ``model``'s attention that the engine cannot compute:
    logit soft-capping (``attn_logit_softcapping``, a ``softcap`` keyword) or attention sinks (a
    ``sinks`` parameter, an ``s_aux`` keyword). ``layers``: ``attention_keywords(model)``."""
    if getattr(model.config, "attn_logit_softcapping", None) or any(kw.get("softcap") for kw in layers.values()):
        raise ValueError("the model soft-caps its attention logits (attn_logit_softcapping): not served")
    if (any(hasattr(module, "sinks") and hasattr(module, "q_proj") for module in model.modules())
            or any(kw.get("s_aux") is not None for kw in layers.values())):
        raise ValueError("the model's attention has sinks: not served")


def context_limit(model: torch.nn.Module, max_model_len: int, asked: int) -> int:
    """The context a node serves ``model`` with: ``max_model_len``, or the narrowest sliding window
    when that is shorter. Raises ValueError when the operator ``asked`` (the config's
    ``max_model_len``, 0: not set) for more than the window, or for a variant
    ``check_attention_variants`` refuses."""
    layers = attention_keywords(model)
    check_attention_variants(model, layers)
    window = sliding_window(layers)
    if window is None or max_model_len <= window:
        return max_model_len
    if asked:
        raise ValueError(f"max_model_len={asked} is past the model's sliding window of {window} tokens, which the "
                         f"paged attention does not compute; set max_model_len to at most {window}")
    return window
