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


PLAIN_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3",
})
"""``model_type``s whose config class (transformers 5) takes ``num_hidden_layers``,
``num_key_value_heads`` and ``head_dim`` as stated: no ``attribute_map`` entry, property or
``__post_init__`` rewrite of a stated value (tests/test_model_geometry.py checks each against
``AutoConfig``). Other types' classes may not: transformers' ``dory`` counts only its
attention layers (36 of a stated 72), ``gemma4_text`` has per-layer head sizes."""


def kv_geometry(model_dir: Path) -> KVGeometry:
    """The KV geometry of the checkpoint in ``model_dir``, as transformers' ``AutoConfig``
    reads it: ``num_hidden_layers``, ``num_key_value_heads``, and ``head_dim`` (or
    ``hidden_size // num_attention_heads`` where it is null or 0).

    Read from config.json itself when its ``model_type`` is one of ``PLAIN_TYPES`` (config
    classes that keep the three as plain attributes: the default model's conversion is
    "llama"), it has no ``per_layer_config`` (transformers' per-layer overrides, for any
    type: ``AutoConfig`` then refuses the global value) and it states all three as positive
    integers; otherwise (another type, whose class may derive them, e.g. a count of attention
    layers only or per-layer head sizes; a key missing, whose default is the class's; an
    alias; a nested ``text_config``; no config.json) ``AutoConfig`` reads it, with its
    defaults and its errors.

    Raises:
        ValueError, OSError: ``AutoConfig``'s, for no config.json there or an unreadable one.
        AttributeError: ``AutoConfig``'s config lacks one of the attributes.
    """
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raw = None
    if (isinstance(raw, dict) and isinstance(raw.get("model_type"), str) and raw["model_type"] in PLAIN_TYPES
            and "per_layer_config" not in raw and _stated(raw, "num_hidden_layers", "num_key_value_heads", "head_dim")):
        return KVGeometry(raw["num_hidden_layers"], raw["num_key_value_heads"], raw["head_dim"])
    from transformers import AutoConfig  # (imports torch)

    mc = AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    return KVGeometry(mc.num_hidden_layers, mc.num_key_value_heads, head_dim)


def _stated(raw: dict, *keys: str) -> bool:
    """Whether config.json states each of ``keys`` as a positive integer (not a bool)."""
    return all(type(raw.get(key)) is int and raw[key] > 0 for key in keys)
