"""A checkpoint's KV geometry (layers, KV heads, head dim) read from its ``config.json``
without transformers: ``from transformers import AutoConfig`` imports torch (~5 s of CPU,
25 s on a loaded 2-core host), and the launcher (``kvstrata up``) needs only these three
numbers, for the spill tier's block format (``services.launcher.spill_block_spec``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple


class KVGeometry(NamedTuple):
    """What one token's KV is per layer: ``num_kv_heads`` heads of ``head_dim`` values, in
    each of ``num_layers`` layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_geometry(model_dir: Path) -> KVGeometry:
    """The KV geometry of the checkpoint in ``model_dir``, as transformers' ``AutoConfig``
    reads it: ``num_hidden_layers``, ``num_key_value_heads``, and ``head_dim`` (or
    ``hidden_size // num_attention_heads`` where it is null or 0).

    Read from config.json itself when it states all three as positive integers (the default
    model's conversion, and Llama/Qwen/Mistral-family checkpoints that transformers wrote);
    otherwise (a key missing, whose default is the model class's, an alias, a nested
    ``text_config``, no config.json) ``AutoConfig`` reads it, with its defaults and its errors.

    Raises:
        ValueError, OSError: ``AutoConfig``'s, for no config.json there or an unreadable one.
        AttributeError: ``AutoConfig``'s config lacks one of the attributes.
    """
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict) and _stated(raw, "num_hidden_layers", "num_key_value_heads", "head_dim"):
        return KVGeometry(raw["num_hidden_layers"], raw["num_key_value_heads"], raw["head_dim"])
    from transformers import AutoConfig  # (imports torch)

    mc = AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    return KVGeometry(mc.num_hidden_layers, mc.num_key_value_heads, head_dim)


def _stated(raw: dict, *keys: str) -> bool:
    """Whether config.json states each of ``keys`` as a positive integer (not a bool)."""
    return all(type(raw.get(key)) is int and raw[key] > 0 for key in keys)
