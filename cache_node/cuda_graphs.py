"""CUDA graphs for decode-only steps and single-sequence prefill chunks, replayed with static inputs.

A decode step launches a few kernels per layer; at small batch sizes the launches, not the
GPU, set the step time. A decode-only step (every sequence computes one token, none under a
KV policy) with the triton backend on CUDA instead copies its inputs into static buffers and
replays the graph captured for the smallest bucket (1, 2, 4, 8, ..., ``max_num_seqs``) that
holds the batch. Padded rows decode token 0 at position 0 with a context of one token: they
read block 0 (harmless) and write their K/V into the scratch slot, a pool slot no sequence
owns (the engine keeps the pool's last block out of the block pool).

Prefill graphs (``PrefillGraphs``): a step whose batch is one plain sequence computing a chunk
of 2 <= q <= ``prefill_graph_max_tokens`` tokens that reaches its last known token (a prefix
hit's suffix, a short prompt) was launch-bound too: on the H200 an 8B model's ~50-token suffix
after ~2,050 cached tokens took 24 ms of host time for ~1,000 launches against 10.9 ms of
device time. It replays the graph of the smallest token bucket Q >= q (16, 32, 64, ...,
the largest). The real rows are the LAST q of the Q rows and keep their token ids, positions
and slots; the padded rows before them (0..Q-q-1) take token 0 at position 0 and write only the
scratch slot. The varlen metadata is that of one sequence of Q queries ending at the chunk's
real end: ``query_start_loc = [0, Q]`` (a constant per bucket), ``seq_lens = [computed + q]``,
so the kernel puts query i at position ``computed + q - Q + i``: the real rows at their own
positions, the padded ones before them (attending earlier context, or nothing); a real row
never sees a padded row's K/V (it went to the scratch slot, in no block table). The kernel
loads no K/V past ``computed + q``, so no slot the model has not written for this sequence
reaches a real row. Regression (review 21b, P1): with the padded rows after the real ones and
``seq_lens = [computed + Q]`` the real rows' KV tiles held stale slots (the last block's
unwritten tail, block 0) at weight 0, and one non-finite stale value made every real row NaN
(``0 * inf``). The step samples hidden row Q-1. What the capture bakes in is fixed per bucket:
the unified kernel's grid (``Q // BLOCK_Q + 1``, KV heads, KV splits), its tile config and
its number of context ranges (split-KV, as a prefix hit's short chunk after a long cached
prefix needs) come from shapes alone (Q tokens, one sequence, the table's width), the context
loop's bounds are read on the device from ``seq_lens``, and the block table is a static
(1, max_blocks + Q_max / block_size) buffer.
The eager step's metadata differs only in ``[0, q]`` and a narrower table.

Every bucket's graph, decode and prefill, is captured when the runner is built, largest token
count first (as vLLM does, so the smaller ones reuse its memory), after a warm-up run on a side
stream (Triton compiles there); all of a runner's graphs share one memory pool (``GraphPool``):
they replay one at a time and each step reads its output before the next replay. Mixed and
multi-sequence prefill steps, chunks that stop mid-prompt, ``all_logits`` and policy steps run
eagerly. Ideas (read, not copied): vLLM's decode
graphs (``CUDAGraphRunner``, ``capture_cudagraph``) and its capture of uniform batches
(``cudagraph_capture_sizes``, piecewise graphs for the rest), nano-vllm's
``capture_cudagraph``, SGLang's ``cuda_graph_runner.py`` (padding a batch to a captured size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from cache_node.attention import AttentionMetadata, ForwardContext, forward_context
from cache_node.attention_backends import VarlenMetadata

if TYPE_CHECKING:
    from cache_node.model_runner import ModelRunner, ScheduledBatch

PREFILL_MIN_BUCKET = 16


def smallest_bucket(buckets: list[int], size: int, what: str) -> int:
    """The smallest of ``buckets`` (ascending) >= ``size``.

    Raises:
        ValueError: ``size`` exceeds the largest (``what`` names it in the message).
    """
    for b in buckets:
        if b >= size:
            return b
    raise ValueError(f"{what} exceeds the largest graph bucket {buckets[-1]}")


def _doubling(first: int, largest: int) -> list[int]:
    """``first``, twice it, ... below ``largest``, then ``largest``."""
    buckets, b = [], first
    while b < largest:
        buckets.append(b)
        b *= 2
    return [*buckets, largest]


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes graphs are captured for: powers of two below ``max_num_seqs``, then it."""
    return _doubling(1, max_num_seqs)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Chunk lengths prefill graphs are captured for: 16, 32, 64, ... below ``max_tokens``,
    then it; [] when ``max_tokens`` < 2 (no chunk of >= 2 tokens fits)."""
    return _doubling(PREFILL_MIN_BUCKET, max_tokens) if max_tokens >= 2 else []


def run_decoder(runner: ModelRunner, md: AttentionMetadata, input_ids: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """The runner's decoder over one flat batch with metadata ``md``: (num_tokens, hidden)."""
    with forward_context(ForwardContext(runner.pool, md, runner.backend)):
        return runner.model.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                                  use_cache=False).last_hidden_state[0]


class GraphPool:
    """The memory pool all of one runner's graphs are captured into (``handle``: None until
    the first capture)."""

    def __init__(self) -> None:
        self.handle: Any = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (twice, on a side stream: Triton compiles, allocator settles), then capture
        ``forward``; returns the graph and its output tensor. The warm-ups run the step the
        static buffers hold, writing the same K/V the replay writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.handle):
            out = forward()
        self.handle = graph.pool()
        return graph, out


class GraphSet(Protocol):
    buckets: list[int]
    graphs: dict[int, Any]

    def capture(self, bucket: int) -> None: ...


class _Graphs:
    """What decode and prefill graph sets share: one graph per bucket over static buffers
    (``_forward``), captured into ``graph_pool``, replayed."""

    graph_pool: GraphPool
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]

    def _forward(self, bucket: int) -> torch.Tensor:
        raise NotImplementedError

    def capture(self, bucket: int) -> None:
        """Capture ``bucket``'s graph over the static buffers as they stand (at build they
        hold padded rows only, which write the scratch slot)."""
        self.graphs[bucket] = self.graph_pool.capture(lambda: self._forward(bucket))

    def replay(self, bucket: int) -> torch.Tensor:
        """Replay ``bucket``'s graph over the loaded static buffers (capturing it first if it
        was not); returns its output, (bucket, hidden_size), valid until the next replay."""
        if bucket not in self.graphs:
            self.capture(bucket)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden


def capture_largest_first(*sets: GraphSet) -> None:
    """Capture every bucket not captured yet of every set, largest token count first."""
    order = sorted(((b, i) for i, s in enumerate(sets) for b in s.buckets), reverse=True)
    for bucket, i in order:
        if bucket not in sets[i].graphs:
            sets[i].capture(bucket)


class DecodeGraphs(_Graphs):
    """Captured decode graphs of one model runner (see the module docstring).

    Args:
        runner: the runner whose model, pool and (triton) backend the graphs replay.
        max_num_seqs: the largest decode batch (the last bucket).
        max_blocks: block-table width, blocks of the longest sequence.
        scratch_slot: pool slot padded rows write to.
        graph_pool: the memory pool shared with the runner's other graphs (None: its own).

    Static buffers (largest bucket ``B``): ``input_ids``/``positions``/``slot_mapping`` (B,)
    int64, ``block_tables`` (B, max_blocks) int32, ``query_start_loc`` (B + 1,) int32 (always
    ``arange``: one query per sequence), ``seq_lens`` (B,) int32.
    """

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_blocks: int, scratch_slot: int,
                 graph_pool: GraphPool | None = None) -> None:
        self.runner = runner
        self.buckets = decode_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.scratch_slot = scratch_slot
        self.max_blocks = max_blocks
        self.graph_pool = graph_pool or GraphPool()
        dev, b = runner.device, self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((b,), scratch_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket >= ``batch_size``; ValueError past the largest."""
        return smallest_bucket(self.buckets, batch_size, f"decode batch of {batch_size}")

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

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Decode one token of every sequence in ``batch`` (plain sequences, one new token
        each); returns their last hidden states, (len(batch), hidden_size), in batch order."""
        return self.replay(self.load(batch))[: len(batch)]

    def _forward(self, bucket: int) -> torch.Tensor:
        """The decoder over the static buffers' first ``bucket`` rows: (bucket, hidden)."""
        md = AttentionMetadata(self.slot_mapping[:bucket], VarlenMetadata(
            None, self.block_tables[:bucket], self.query_start_loc[: bucket + 1], self.seq_lens[:bucket]))
        return run_decoder(self.runner, md, self.input_ids[:bucket], self.positions[:bucket])


class PrefillGraphs(_Graphs):
    """Captured single-sequence prefill graphs of one model runner (see the module docstring).

    Args:
        runner: the runner whose model, pool and (triton) backend the graphs replay.
        max_tokens: the largest chunk (the last bucket; ``prefill_buckets``).
        max_blocks: blocks of the longest sequence.
        scratch_slot: pool slot padded rows write to.
        graph_pool: the memory pool shared with the runner's other graphs (None: its own).

    Static buffers (largest bucket ``Q``): ``input_ids``/``positions``/``slot_mapping`` (Q,)
    int64; ``block_tables`` (1, max_blocks + ceil(Q / block_size)) int32, so ``computed + Q``
    positions always map inside the row; ``seq_lens`` (1,) int32; ``query_start_loc`` one
    constant (2,) int32 ``[0, bucket]`` per bucket.
    """

    def __init__(self, runner: ModelRunner, max_tokens: int, max_blocks: int, scratch_slot: int,
                 graph_pool: GraphPool | None = None) -> None:
        self.runner = runner
        self.buckets = prefill_buckets(max_tokens)
        if not self.buckets:
            raise ValueError(f"prefill graphs need a largest chunk of >= 2 tokens; got {max_tokens}")
        self.max_tokens = self.buckets[-1]
        self.scratch_slot = scratch_slot
        self.max_blocks = max_blocks
        self.graph_pool = graph_pool or GraphPool()
        dev, q, bs = runner.device, self.max_tokens, runner.pool.block_size
        self.input_ids = torch.zeros(q, dtype=torch.long, device=dev)
        self.positions = torch.zeros(q, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((q,), scratch_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros((1, max_blocks + -(-q // bs)), dtype=torch.int32, device=dev)
        self.seq_lens = torch.full((1,), q, dtype=torch.int32, device=dev)
        self.query_start_loc = {b: torch.tensor([0, b], dtype=torch.int32, device=dev) for b in self.buckets}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, batch: ScheduledBatch) -> bool:
        """True when ``batch`` is one plain sequence whose chunk of 2..``max_tokens`` tokens
        reaches its last known token (it samples one row) within ``max_blocks`` blocks, after
        at least as many computed tokens as its bucket pads (the padded rows, placed before
        the real ones, sit at computed positions: a kernel's sequence is never shorter than
        its queries). A short cold prompt whose length is no bucket runs eagerly."""
        if len(batch) != 1:
            return False
        seq, n = batch[0]
        end = seq.num_computed_tokens + n
        return (seq.kv is None and 2 <= n <= self.max_tokens and end == seq.num_tokens
                and -(-end // self.runner.pool.block_size) <= self.max_blocks
                and self.bucket(n) - n <= seq.num_computed_tokens)

    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket >= ``num_tokens``; ValueError past the largest."""
        return smallest_bucket(self.buckets, num_tokens, f"prefill chunk of {num_tokens} tokens")

    def host_arrays(self, batch: ScheduledBatch, bucket: int) -> dict[str, np.ndarray]:
        """The chunk's inputs padded to ``bucket`` rows, the real ones last (int64):
        ``input_ids``, ``positions``, ``slot_mapping`` (bucket,), ``seq_lens`` (1,) = computed
        + q and ``block_tables`` (1, ceil((computed + q) / block_size)): the sequence's blocks."""
        [(seq, n)] = batch
        bs, start, pad = self.runner.pool.block_size, seq.num_computed_tokens, bucket - n
        blocks = np.array([b.block_id for b in seq.block_table[: -(-(start + n) // bs)]], np.int64)
        pos = np.arange(start, start + n)
        arrays = {
            "input_ids": np.zeros(bucket, np.int64), "positions": np.zeros(bucket, np.int64),
            "slot_mapping": np.full(bucket, self.scratch_slot, np.int64),
            "seq_lens": np.array([start + n], np.int64),
            "block_tables": blocks.reshape(1, -1),
        }
        arrays["input_ids"][pad:] = seq.all_token_ids[start : start + n]
        arrays["positions"][pad:] = pos
        arrays["slot_mapping"][pad:] = blocks[pos // bs] * bs + pos % bs
        return arrays

    def load(self, batch: ScheduledBatch) -> int:
        """Copy the chunk's padded inputs into the static buffers (one host->device copy, then
        device-side copies); returns the bucket."""
        from cache_node.model_runner import to_device

        bucket = self.bucket(batch[0][1])
        dev = to_device(self.host_arrays(batch, bucket), self.runner.device)
        self.input_ids[:bucket].copy_(dev["input_ids"])
        self.positions[:bucket].copy_(dev["positions"])
        self.slot_mapping[:bucket].copy_(dev["slot_mapping"])
        self.seq_lens.copy_(dev["seq_lens"])
        self.block_tables[:, : dev["block_tables"].shape[1]].copy_(dev["block_tables"])
        return bucket

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the chunk of ``batch``'s one sequence; returns the hidden state of its last
        token (the bucket's last row), (1, hidden_size)."""
        bucket = self.load(batch)
        return self.replay(bucket)[bucket - 1 : bucket]

    def _forward(self, bucket: int) -> torch.Tensor:
        """The decoder over the static buffers' first ``bucket`` rows as one sequence of
        ``bucket`` queries: (bucket, hidden)."""
        md = AttentionMetadata(self.slot_mapping[:bucket], VarlenMetadata(
            None, self.block_tables, self.query_start_loc[bucket], self.seq_lens))
        return run_decoder(self.runner, md, self.input_ids[:bucket], self.positions[:bucket])
