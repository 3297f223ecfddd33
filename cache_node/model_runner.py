"""Runs one engine step through the model: flattened batch in, next-token logits out.

Every integer the step needs (token ids, positions, slot mapping, sample indices, the
attention backend's metadata, policy sequences' context slots) is built on the host as
numpy and reaches the model's device in one copy (``to_device``: pinned and non-blocking on
CUDA); nothing in a step reads a device value back, so the only host sync of a step is the
sampler's (``sampler.sample``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cache_node.attention import (
    ATTN_IMPLEMENTATION,
    AttentionMetadata,
    PolicyChunk,
)
from cache_node.attention_backends import DeviceArrays, HostArrays, SeqStep, get_backend
from cache_node.config import EngineConfig
from cache_node.cuda_graphs import run_decoder
from cache_node.fused_layers import apply_fused_kernels
from cache_node.kv_pool import KVPool, block_slots
from cache_node.outputs import SequenceFault
from cache_node.sequence import Sequence

if TYPE_CHECKING:  # annotations only
    from transformers import PreTrainedModel

    from cache_node.cuda_graphs import DecodeGraphs, PrefillGraphs

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, tokens to compute this step)


def to_device(arrays: HostArrays, device: torch.device) -> DeviceArrays:
    """Copy int64 host arrays to ``device`` as one buffer; returns views of it by name, each
    with its array's shape. CUDA: one pinned, non-blocking host->device copy (ordered on the
    current stream before the kernels that read it); CPU: views of the host memory, no copy."""
    flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays.values()])
    buf = torch.from_numpy(flat)
    if device.type != "cpu":
        buf = buf.pin_memory().to(device, non_blocking=True)
    out, offset = {}, 0
    for name, a in arrays.items():
        out[name] = buf[offset : offset + a.size].view(a.shape)
        offset += a.size
    return out


@dataclass
class HostStep:
    """A step planned on the host: ``arrays`` for ``to_device``; ``steps`` the plain
    sequences; ``policy`` (flat start, num_tokens, sequence, start and end of its context in
    ``policy_slots``) per policy-managed sequence; ``backend_host`` the backend's host-side
    facts."""

    arrays: HostArrays
    num_tokens: int
    steps: list[SeqStep] = field(default_factory=list)
    policy: list[tuple[int, int, Sequence, int, int]] = field(default_factory=list)
    backend_host: Any = None


class ModelRunner:
    """Owns the model and the pool tensor; turns scheduled work into one forward pass.

    Args:
        model: a transformers causal LM (Llama/Qwen/Mistral family) on the pool's device; its
            attention is switched to the paged implementation.
        pool: the KV pool tensor the attention reads and writes.
        config: the engine's config (``attention_backend``, ``cuda_graphs``); None: the
            defaults on the pool's device.
        scratch_slot: a pool slot no sequence owns, where padded rows of CUDA-graph steps
            write their K/V (``cuda_graphs.DecodeGraphs``, ``cuda_graphs.PrefillGraphs``); None
            disables graphs.
        max_model_len: the context the node serves (tokens: ``LLMEngine.max_model_len``, the
            config's or the model's capped at its narrowest sliding window); 0: the config's,
            else the model's ``max_position_embeddings``. Sizes ``graph_max_blocks``.
    """

    def __init__(self, model: PreTrainedModel, pool: KVPool, config: EngineConfig | None = None,
                 scratch_slot: int | None = None, max_model_len: int = 0) -> None:
        self.config = (config or EngineConfig(device=str(pool.kv.device))).resolved()
        max_len = max_model_len or self.config.max_model_len or model.config.max_position_embeddings
        # block-table width of the CUDA graphs: blocks of the longest sequence the node serves.
        # Regression (s39): sized from the config's/model's length, not the window-capped one
        # (a 4k-window model of 128k positions: 32x wider tables, each graph's buffers with them)
        self.graph_max_blocks = min(pool.num_blocks, -(-max_len // pool.block_size))
        self.model = model
        self.pool = pool
        self.device = pool.kv.device
        self.backend = get_backend(self.config.attention_backend)(pool.block_size)
        model.config._attn_implementation = ATTN_IMPLEMENTATION
        model.eval()
        # Serving never trains: no forward of this model records autograd, wherever it runs.
        # Regression (review 24g F1): the graph captures ran with grad on over weights that
        # required it; with fused kernels off, the pool's K/V writes made ``pool.kv`` require
        # grad, keeping every capture's activations alive (~4.7 GiB on Llama-3.1-8B) and
        # chaining each tier copy onto it.
        model.requires_grad_(False)
        self.fused_modules = apply_fused_kernels(model, self.config)  # before graphs capture
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if scratch_slot is not None and self.uses_cuda_graphs(self.config):
            self._build_graphs(scratch_slot)

    def _build_graphs(self, scratch_slot: int) -> None:
        """Decode graphs, and prefill graphs when ``prefill_graph_max_tokens`` (capped at the
        step budget) is >= 2; every bucket captured now, not inside the first steps."""
        from cache_node import cuda_graphs as cg

        cfg, max_blocks = self.config, self.graph_max_blocks
        graph_pool = cg.GraphPool()
        self.graphs = cg.DecodeGraphs(self, cfg.max_num_seqs, max_blocks, scratch_slot, graph_pool)
        largest = min(cfg.prefill_graph_max_tokens, cfg.max_num_batched_tokens)
        if largest >= 2:
            self.prefill_graphs = cg.PrefillGraphs(self, largest, max_blocks, scratch_slot, graph_pool)
        with torch.no_grad():  # as ``execute``: a capture records no autograd (above)
            cg.capture_largest_first(*(g for g in (self.graphs, self.prefill_graphs) if g is not None))

    @staticmethod
    def uses_cuda_graphs(config: EngineConfig) -> bool:
        """Decode steps replay CUDA graphs: a resolved config on CUDA with the triton backend
        and ``cuda_graphs`` on."""
        cuda = config.device.startswith("cuda")
        return cuda and config.attention_backend == "triton" and config.cuda_graphs

    def plan(self, batch: ScheduledBatch, all_logits: bool = False) -> HostStep:
        """The step's host arrays: ``input_ids``, ``positions``, ``slot_mapping`` (num_tokens,),
        ``sample_idx`` (one flat index per sampled row), ``policy_slots`` and the backend's."""
        bs = self.pool.block_size
        ids: list[int] = []
        sample_idx: list[int] = []
        positions, slots, policy_slots = [], [], []
        host = HostStep({}, 0)
        flat = policy_offset = 0
        for seq, n in batch:
            start = seq.num_computed_tokens
            phys = start - seq.num_evicted_tokens  # physical slots in use (policies compact)
            block_ids = [b.block_id for b in seq.block_table]
            ids.extend(seq.all_token_ids[start : start + n])
            positions.append(np.arange(start, start + n))
            new = np.arange(phys, phys + n)  # the new tokens' physical slots -> pool slots
            slots.append(np.asarray(block_ids, np.int64)[new // bs] * bs + new % bs)
            if seq.kv is not None:  # policy-managed layout: attends itself
                ctx_slots = block_slots(block_ids, bs, phys + n)
                host.policy.append((flat, n, seq, policy_offset, policy_offset + len(ctx_slots)))
                policy_slots.append(ctx_slots)
                policy_offset += len(ctx_slots)
            else:
                host.steps.append(SeqStep(flat, n, phys + n, block_ids))
            flat += n
            if all_logits:
                sample_idx.extend(range(flat - n, flat))
            elif start + n == seq.num_tokens:
                sample_idx.append(flat - 1)
        host.num_tokens = flat
        empty = np.zeros(0, np.int64)
        host.arrays = {
            "input_ids": np.array(ids, np.int64), "positions": np.concatenate(positions),
            "slot_mapping": np.concatenate(slots), "sample_idx": np.array(sample_idx, np.int64),
            "policy_slots": np.concatenate(policy_slots or [empty]),
        }
        if host.steps:
            backend_arrays, host.backend_host = self.backend.plan(host.steps, flat)
            host.arrays |= backend_arrays
        return host

    def metadata(self, host: HostStep, dev: DeviceArrays) -> AttentionMetadata:
        """The step's attention metadata from its arrays on the device."""
        backend = self.backend.metadata(host.steps, dev, host.backend_host) if host.steps else None
        chunks = [PolicyChunk(flat, n, dev["policy_slots"][a:b], seq.kv) for flat, n, seq, a, b in host.policy]
        return AttentionMetadata(dev["slot_mapping"], backend, chunks)

    def decode_only(self, batch: ScheduledBatch, all_logits: bool = False) -> bool:
        """True when the step replays a decode graph: graphs are on, the batch fits the largest
        bucket, and every sequence is plain and computes its one last known token (so every
        row samples), after at least one computed token."""
        return (self.graphs is not None and not all_logits and len(batch) <= self.graphs.max_batch
                and all(n == 1 and seq.kv is None and 0 < seq.num_computed_tokens == seq.num_tokens - 1
                        for seq, n in batch))

    def single_prefill(self, batch: ScheduledBatch, all_logits: bool = False) -> bool:
        """True when the step replays a prefill graph: prefill graphs are on, not
        ``all_logits``, and the batch is one plain sequence whose chunk of 2 to the largest
        bucket's tokens reaches its last known token (``PrefillGraphs.fits``)."""
        return self.prefill_graphs is not None and not all_logits and self.prefill_graphs.fits(batch)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, all_logits: bool = False,
                on_hidden: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Compute ``n`` tokens of each scheduled sequence and return logits to sample from.

        ``all_logits=True`` (quality harness): one row per computed token instead.
        ``on_hidden``: called with the step's final hidden states (num_tokens, hidden), one row
        per computed token in batch order, before the sampled rows' logits; the step then runs
        eager, not a CUDA graph (prompt logprobs: ``cache_node.prompt_logprobs``).

        Returns:
            (num_sampling_seqs, vocab_size) float32 logits on the pool's device, one row per
            sequence whose chunk reaches its last known token (in batch order); chunks
            mid-prompt produce no row.

        Raises:
            SequenceFault: one policy-managed sequence's ``begin_step`` or ``attend`` raised;
                the step's KV writes are partial (``LLMEngine.step`` recovers).
        """
        for seq, n in batch:
            if seq.kv is not None:
                try:
                    seq.kv.begin_step(seq.num_computed_tokens, n)
                except Exception as exc:
                    raise SequenceFault(seq.request_id) from exc
        eager = all_logits or on_hidden is not None
        if self.decode_only(batch, eager):
            assert self.graphs is not None
            hidden = self.graphs.run(batch)  # every decode samples: rows in batch order
            return self.model.lm_head(hidden).float()
        if self.single_prefill(batch, eager):
            assert self.prefill_graphs is not None
            hidden = self.prefill_graphs.run(batch)  # the chunk's last row: its one sample
            return self.model.lm_head(hidden).float()
        host = self.plan(batch, all_logits)
        dev = to_device(host.arrays, self.device)
        hidden = run_decoder(self, self.metadata(host, dev), dev["input_ids"], dev["positions"])
        if on_hidden is not None:
            on_hidden(hidden)
        if not len(host.arrays["sample_idx"]):
            return torch.empty((0, self.model.config.vocab_size), device=self.device)
        return self.model.lm_head(hidden.index_select(0, dev["sample_idx"])).float()
