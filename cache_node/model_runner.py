"""Runs one engine step through the model: flattened batch in, next-token logits out."""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from cache_node.attention import (
    ATTN_IMPLEMENTATION,
    AttentionMetadata,
    ForwardContext,
    PrefillChunk,
    forward_context,
)
from cache_node.config import EngineConfig
from cache_node.kv_pool import KVPool, block_slots
from cache_node.sequence import Sequence

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, tokens to compute this step)


class ModelRunner:
    """Owns the model and the pool tensor; turns scheduled work into one forward pass.

    Args:
        model: a transformers causal LM (Llama/Qwen/Mistral family); its attention is switched
            to the paged implementation.
        pool: the KV pool tensor the attention reads and writes.
    """

    def __init__(self, model: PreTrainedModel, pool: KVPool, config: EngineConfig | None = None) -> None:
        self.config = (config or EngineConfig(device=str(pool.kv.device))).resolved()
        self.model = model
        self.pool = pool
        self.device = pool.kv.device
        model.config._attn_implementation = ATTN_IMPLEMENTATION
        model.eval()

    def _metadata(self, batch: ScheduledBatch) -> AttentionMetadata:
        bs = self.pool.block_size
        slot_mapping, decode_idx, decode_slots, prefills = [], [], [], []
        flat = 0
        for seq, n in batch:
            start = seq.num_computed_tokens
            phys = start - seq.num_evicted_tokens  # physical slots in use (policies compact)
            ctx_slots = block_slots([b.block_id for b in seq.block_table], bs, phys + n)
            slot_mapping.append(ctx_slots[phys:])
            if seq.kv is not None:  # policy-managed layout: per-layer masks, stats, extra KV
                prefills.append(PrefillChunk(flat, n, torch.from_numpy(ctx_slots), None, seq.kv))
            elif n == 1 and start > 0:
                decode_idx.append(flat)
                decode_slots.append(ctx_slots)
            else:
                mask = None
                if start > 0:
                    q_pos = torch.arange(start, start + n).unsqueeze(1)
                    mask = torch.arange(start + n).unsqueeze(0) <= q_pos
                prefills.append(PrefillChunk(flat, n, torch.from_numpy(ctx_slots), mask))
            flat += n
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_mapping)), prefills=prefills
        )
        if decode_idx:
            md.decode_token_idx = torch.tensor(decode_idx, dtype=torch.long)
            md.decode_slots = torch.from_numpy(np.concatenate(decode_slots))
            md.decode_offsets = tuple(np.cumsum([0] + [len(s) for s in decode_slots]).tolist())
        return md

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, all_logits: bool = False) -> torch.Tensor:
        """Compute ``n`` tokens of each scheduled sequence and return logits to sample from.

        ``all_logits=True`` (quality harness): one row per computed token instead.

        Returns:
            (num_sampling_seqs, vocab_size) float32 logits, one row per sequence whose chunk
            reaches its last known token (in batch order); chunks mid-prompt produce no row.
        """
        input_ids, positions, sample_idx = [], [], []
        flat = 0
        for seq, n in batch:
            start = seq.num_computed_tokens
            input_ids.extend(seq.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            flat += n
            if all_logits:
                sample_idx.extend(range(flat - n, flat))
            elif start + n == seq.num_tokens:
                sample_idx.append(flat - 1)
        for seq, n in batch:
            if seq.kv is not None:
                seq.kv.begin_step(seq.num_computed_tokens, n)
        md = self._metadata(batch)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)
        with forward_context(ForwardContext(self.pool, md)):
            hidden = self.model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        if not sample_idx:
            return torch.empty((0, self.model.config.vocab_size))
        last = hidden[0].index_select(0, torch.tensor(sample_idx, device=self.device))
        return self.model.lm_head(last).float()
