"""Attention variants of a checkpoint that the paged attention does not compute, found at load.

The engine's attention (``cache_node.attention``) is causal attention over every earlier token.
transformers hands a layer's variants to it as keyword arguments it does not read: a sliding
window (Mistral's ``sliding_window``, Qwen2's sliding layers), logit soft-capping (Gemma2) or
attention sinks (gpt-oss). Ignored, each would compute other KV and tokens than the model,
silently. So a context is kept within the narrowest sliding window (inside it, windowed and full
attention are the same), and the other variants are refused.
"""

from __future__ import annotations

import torch


def sliding_window(model: torch.nn.Module) -> int | None:
    """The narrowest sliding window any attention layer of ``model`` uses (tokens), None when none
    does: a layer's own ``sliding_window`` attribute when it has one (None: full attention),
    else the config's ``sliding_window`` (Mistral passes it to every layer)."""
    config_window = getattr(model.config, "sliding_window", None)
    windows = []
    for module in model.modules():
        if not (hasattr(module, "layer_idx") and hasattr(module, "q_proj")):
            continue  # not an attention layer
        window = getattr(module, "sliding_window", config_window)
        if isinstance(window, int) and window > 0:
            windows.append(window)
    return min(windows, default=None)


def check_attention_variants(model: torch.nn.Module) -> None:
    """Raise ValueError naming a variant of ``model``'s attention that the engine cannot compute:
    logit soft-capping (``attn_logit_softcapping``) or attention sinks (a ``sinks`` parameter)."""
    if getattr(model.config, "attn_logit_softcapping", None):
        raise ValueError("the model soft-caps its attention logits (attn_logit_softcapping): not served")
    if any(hasattr(module, "sinks") and hasattr(module, "q_proj") for module in model.modules()):
        raise ValueError("the model's attention has sinks: not served")


def context_limit(model: torch.nn.Module, max_model_len: int, asked: int) -> int:
    """The context a node serves ``model`` with: ``max_model_len``, or the narrowest sliding window
    when that is shorter. Raises ValueError when the operator ``asked`` (the config's
    ``max_model_len``, 0: not set) for more than the window, or for a variant
    ``check_attention_variants`` refuses."""
    check_attention_variants(model)
    window = sliding_window(model)
    if window is None or max_model_len <= window:
        return max_model_len
    if asked:
        raise ValueError(f"max_model_len={asked} is past the model's sliding window of {window} tokens, which the "
                         f"paged attention does not compute; set max_model_len to at most {window}")
    return window
