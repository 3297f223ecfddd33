"""The launcher's torch-free reads of a checkpoint (``cache_node.model_geometry.kv_geometry``)
and of a KV dtype (``cache_node.tiers.spill_api.numpy_dtype_name``) give what transformers'
``AutoConfig`` and torch gave it before (s39: the launcher imports neither), so the spill
tier's block format (``services.launcher.spill_block_spec``) is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from cache_node.config import DTYPE_NAMES
from cache_node.model_files import resolve_model_dir
from cache_node.model_geometry import KVGeometry, kv_geometry
from cache_node.tiers.spill_api import numpy_dtype_name, numpy_dtype_of


def auto_config_geometry(model_dir: Path) -> KVGeometry:
    """The launcher's reading before s39, verbatim."""
    mc = AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    return KVGeometry(mc.num_hidden_layers, mc.num_key_value_heads, head_dim)


def test_the_default_model_reads_as_auto_config_reads_it() -> None:
    """SmolLM2-135M's conversion: 30 layers, 3 KV heads of 64, read from config.json."""
    model_dir = resolve_model_dir(None)
    assert kv_geometry(model_dir) == auto_config_geometry(model_dir) == KVGeometry(30, 3, 64)


QWEN2_NO_HEAD_DIM = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                     "intermediate_size": 128, "vocab_size": 256}
"""A config.json that states neither ``head_dim`` nor ``num_key_value_heads``: Qwen2Config's own
default of the latter (32) is not ``num_attention_heads``, so only ``AutoConfig`` knows it."""


@pytest.mark.parametrize("config", [
    QWEN2_NO_HEAD_DIM,
    {**QWEN2_NO_HEAD_DIM, "num_key_value_heads": 2},  # head_dim derived (hidden_size // heads)
    {**QWEN2_NO_HEAD_DIM, "num_key_value_heads": 2, "head_dim": 32},  # stated: read directly
    {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3,
     "num_key_value_heads": 1, "head_dim": None, "vocab_size": 256},  # null head_dim: LlamaConfig derives it
], ids=["qwen2-defaults", "no-head-dim", "all-stated", "llama-null-head-dim"])
def test_a_config_missing_a_key_reads_as_auto_config_reads_it(config: dict, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kv_geometry(tmp_path) == auto_config_geometry(tmp_path)


def test_no_config_json_is_auto_config_s_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as theirs:
        auto_config_geometry(tmp_path)
    with pytest.raises(ValueError) as ours:
        kv_geometry(tmp_path)
    assert str(ours.value) == str(theirs.value) and "Unrecognized model" in str(ours.value)


@pytest.mark.parametrize("name", [n for n in DTYPE_NAMES if n != "auto"])
def test_a_kv_dtype_travels_as_numpy_dtype_of_its_torch_dtype(name: str) -> None:
    assert numpy_dtype_name(name) == numpy_dtype_of(getattr(torch, name)).name
