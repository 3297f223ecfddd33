"""CUDA graphs for decode-only steps: one graph per batch-size bucket, replayed with static inputs.

A decode step launches a few kernels per layer; at small batch sizes the launches, not the
GPU, set the step time. A decode-only step (every sequence computes one token, none under a
KV policy) with the triton backend on CUDA instead copies its inputs into static buffers and
replays the graph captured for the smallest bucket (1, 2, 4, 8, ..., ``max_num_seqs``) that
holds the batch. Padded rows decode token 0 at position 0 with a context of one token: they
read block 0 (harmless) and write their K/V into the scratch slot, a pool slot no sequence
owns (the engine keeps the pool's last block out of the block pool). Every bucket's graph is
captured when the runner is built (largest first, as vLLM does, so the smaller ones reuse its
memory), after a warm-up run on a side stream (Triton compiles there); they share one memory
pool. Before, each was captured by the first step that needed it: on the H200 that put the
capture inside the first steps that served requests. Prefill, mixed and policy steps run eagerly. Idea: vLLM's and nano-vllm's decode graphs
(``CUDAGraphRunner``, ``capture_cudagraph``), SGLang's ``cuda_graph_runner.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cache_node.attention import AttentionMetadata, ForwardContext, forward_context
from cache_node.attention_backends import VarlenMetadata

if TYPE_CHECKING:
    from cache_node.model_runner import ModelRunner, ScheduledBatch


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes graphs are captured for: powers of two below ``max_num_seqs``, then it."""
    buckets, b = [], 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return [*buckets, max_num_seqs]


class DecodeGraphs:
    """Captured decode graphs of one model runner (see the module docstring).

    Args:
        runner: the runner whose model, pool and (triton) backend the graphs replay.
        max_num_seqs: the largest decode batch (the last bucket).
        max_blocks: block-table width, blocks of the longest sequence.
        scratch_slot: pool slot padded rows write to.

    Static buffers (largest bucket ``B``): ``input_ids``/``positions``/``slot_mapping`` (B,)
    int64, ``block_tables`` (B, max_blocks) int32, ``query_start_loc`` (B + 1,) int32 (always
    ``arange``: one query per sequence), ``seq_lens`` (B,) int32.
    """

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_blocks: int, scratch_slot: int) -> None:
        self.runner = runner
        self.buckets = decode_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.scratch_slot = scratch_slot
        self.max_blocks = max_blocks
        dev, b = runner.device, self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((b,), scratch_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_pool: Any = None

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket >= ``batch_size``; ValueError past the largest."""
        for b in self.buckets:
            if b >= batch_size:
                return b
        raise ValueError(f"decode batch of {batch_size} exceeds the largest graph bucket {self.max_batch}")

    def host_arrays(self, batch: ScheduledBatch, bucket: int) -> dict[str, np.ndarray]:
        """The step's inputs padded to ``bucket`` rows (int64): ``input_ids``, ``positions``,
        ``slot_mapping``, ``seq_lens`` (bucket,) and ``block_tables`` (bucket, widest
        table this step)."""
        bs = self.runner.pool.block_size
        width = max(-(-(seq.num_computed_tokens + 1) // bs) for seq, _ in batch)
        arrays = {
            "input_ids": np.zeros(bucket, np.int64), "positions": np.zeros(bucket, np.int64),
            "slot_mapping": np.full(bucket, self.scratch_slot, np.int64),
            "seq_lens": np.ones(bucket, np.int64), "block_tables": np.zeros((bucket, width), np.int64),
        }
        for row, (seq, _) in enumerate(batch):
            pos = seq.num_computed_tokens
            blocks = [b.block_id for b in seq.block_table[: -(-(pos + 1) // bs)]]
            arrays["input_ids"][row] = seq.all_token_ids[pos]
            arrays["positions"][row] = pos
            arrays["slot_mapping"][row] = blocks[pos // bs] * bs + pos % bs
            arrays["seq_lens"][row] = pos + 1
            arrays["block_tables"][row, : len(blocks)] = blocks
        return arrays

    def load(self, batch: ScheduledBatch) -> int:
        """Copy the step's padded inputs into the static buffers (one host->device copy, then
        device-side copies); returns the bucket."""
        from cache_node.model_runner import to_device

        bucket = self.bucket(len(batch))
        dev = to_device(self.host_arrays(batch, bucket), self.runner.device)
        width = dev["block_tables"].shape[1]
        self.input_ids[:bucket].copy_(dev["input_ids"])
        self.positions[:bucket].copy_(dev["positions"])
        self.slot_mapping[:bucket].copy_(dev["slot_mapping"])
        self.seq_lens[:bucket].copy_(dev["seq_lens"])
        self.block_tables[:bucket, :width].copy_(dev["block_tables"])
        return bucket

    def capture_all(self) -> None:
        """Capture every bucket's graph not captured yet, largest first. The warm-ups and
        captures run the static buffers' padded rows: they write only the scratch slot."""
        for bucket in reversed(self.buckets):
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket)

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Decode one token of every sequence in ``batch`` (plain sequences, one new token
        each); returns their last hidden states, (len(batch), hidden_size), in batch order."""
        bucket = self.load(batch)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden[: len(batch)]

    def _forward(self, bucket: int) -> torch.Tensor:
        """The decoder over the static buffers' first ``bucket`` rows: (bucket, hidden)."""
        md = AttentionMetadata(self.slot_mapping[:bucket], VarlenMetadata(
            None, self.block_tables[:bucket], self.query_start_loc[: bucket + 1], self.seq_lens[:bucket]))
        runner = self.runner
        with forward_context(ForwardContext(runner.pool, md, runner.backend)):
            out = runner.model.model(
                input_ids=self.input_ids[:bucket].unsqueeze(0),
                position_ids=self.positions[:bucket].unsqueeze(0), use_cache=False,
            ).last_hidden_state[0]
        return out

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (twice, on a side stream: Triton compiles, allocator settles), then capture.
        The warm-up runs the step itself, writing the same K/V the replay writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            hidden = self._forward(bucket)
        self.memory_pool = graph.pool()
        return graph, hidden
