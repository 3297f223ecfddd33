"""The CUDA graphs' block tables are as wide as the longest sequence the node serves: its
effective ``max_model_len`` (``LLMEngine.max_model_len``, capped at the narrowest sliding window
by ``cache_node.attention_limits``), not the config's or the model's position count.

Regression (s39): ``ModelRunner._build_graphs`` sized them from ``max_model_len`` of the config,
else ``max_position_embeddings``: a model with a 16-token window of 2048 positions got tables of
512 blocks where 4 hold every sequence it serves (memory only: each decode bucket's and the
prefill graphs' static buffers). Checked on CPU: the graph sets' static buffers are built for
real, only ``GraphPool.capture`` (CUDA streams and graphs) records the bucket instead.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cache_node import cuda_graphs as cg
from cache_node.engine import LLMEngine
from tests.test_attention_limits import CFG, SMALL, mistral


def _built(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Build ``engine``'s graph sets as a CUDA node does (``_build_graphs``), capture left out;
    returns the buckets it would capture."""
    captured: list[int] = []

    def capture(self: cg._Graphs, bucket: int) -> None:
        captured.append(bucket)
        self.graphs[bucket] = (None, None)  # type: ignore[assignment]

    monkeypatch.setattr(cg._Graphs, "capture", capture)
    engine.runner._build_graphs(scratch_slot=0)
    return captured


def test_a_windowed_models_graph_tables_hold_its_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """16-token window, 4-token blocks: 4 blocks per decode row; the prefill table 4 more than
    its chunk's blocks. Before: 512 (2048 positions / 4, the pool's whole size here)."""
    engine = LLMEngine(mistral(16), CFG, "mistral")
    assert engine.max_model_len == 16 and engine.pool.num_blocks >= 512
    buckets = _built(engine, monkeypatch)
    decode, prefill = engine.runner.graphs, engine.runner.prefill_graphs
    assert decode is not None and decode.block_tables.shape == (decode.max_batch, 4)
    assert prefill is not None and prefill.max_blocks == 4
    assert prefill.block_tables.shape == (1, 4 + -(-prefill.max_tokens // CFG.block_size))
    assert sorted(buckets) == sorted(decode.buckets + prefill.buckets)


def test_a_full_attention_models_tables_hold_its_positions_within_the_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No window: the model's 2048 positions, 512 blocks of 4, at most the pool's blocks."""
    torch.manual_seed(0)
    engine = LLMEngine(LlamaForCausalLM(LlamaConfig(**SMALL)).eval(), CFG, "llama")
    _built(engine, monkeypatch)
    assert engine.runner.graphs is not None
    assert engine.runner.graphs.max_blocks == min(512, engine.pool.num_blocks)
