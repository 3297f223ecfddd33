"""The launcher's torch-free reads of a checkpoint (``cache_node.model_geometry.kv_geometry``)
and of a KV dtype (``cache_node.tiers.spill_api.numpy_dtype_name``) give what transformers'
``AutoConfig`` and torch gave it before (s39: the launcher imports neither), so the spill
tier's block format (``services.launcher.spill_block_spec``) is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from cache_node.config import DTYPE_NAMES
from cache_node.model_files import resolve_model_dir
from cache_node.model_geometry import PLAIN_TYPES, KVGeometry, kv_geometry
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


def read_as(read, model_dir: Path) -> KVGeometry | str:
    """``read(model_dir)``, or the name and text of what it raised."""
    try:
        return read(model_dir)
    except Exception as err:  # noqa: BLE001 - compared between the two readings
        return f"{type(err).__name__}: {err}"


def transformers_default(model_type: str) -> dict:
    """config.json as transformers writes its default config of ``model_type``."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    return json.loads(AutoConfig.for_model(model_type).to_json_string(use_diff=False))


@pytest.mark.parametrize("model_type", ["dory", "gemma4_text"])
def test_a_type_whose_class_derives_its_geometry_reads_as_auto_config_reads_it(model_type: str,
                                                                                 tmp_path: Path) -> None:
    """States all three keys as positive integers, which its class does not read as stated:
    dory counts its attention layers only (36 of 72), gemma4_text has per-layer head sizes
    (``AutoConfig`` refuses the global ``head_dim``). s39 review r5: read from config.json,
    dory gave 72 layers and gemma4_text a head_dim of 256, where AutoConfig gave 36 and an
    error."""
    config = transformers_default(model_type)
    assert all(type(config[key]) is int for key in ("num_hidden_layers", "num_key_value_heads", "head_dim"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_as(kv_geometry, tmp_path) == read_as(auto_config_geometry, tmp_path)


def test_a_per_layer_config_reads_as_auto_config_reads_it(tmp_path: Path) -> None:
    """A Llama whose layer 1 has 1 KV head (transformers' ``per_layer_config``, any type):
    ``AutoConfig`` refuses its global ``num_key_value_heads``; read from config.json it was 2."""
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
              "per_layer_config": {"1": {"num_key_value_heads": 1}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_as(kv_geometry, tmp_path) == read_as(auto_config_geometry, tmp_path)


@pytest.mark.parametrize("model_type", sorted(PLAIN_TYPES))
def test_each_plain_type_states_what_auto_config_reads(model_type: str, tmp_path: Path) -> None:
    """Each type read from config.json itself keeps stated values as its class would: its
    default config with 3 layers, 1 KV head of 32 (not hidden_size // heads) reads the same
    both ways (a transformers upgrade that derives one of them fails here)."""
    config = {**transformers_default(model_type), "num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 32}
    config.pop("layer_types", None)  # one per layer: the class makes 3 of its pattern
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_as(kv_geometry, tmp_path) == read_as(auto_config_geometry, tmp_path) == KVGeometry(3, 1, 32)
