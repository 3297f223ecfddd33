"""Low-level driver for the quality harness: prefill once, compress once, ask many.

It drives the engine's own pieces (pool, block pool, model runner, ``SequenceKV``) so a
context is prefilled once with every statistic collected, then forked per policy and budget
(copying blocks, never sharing compacted ones), compressed once, and forked again per question.

A fork under a policy keeps only the statistics that policy collects itself (its
``StatsNeeds``), and each question starts a new turn as ``cache_node.sessions`` starts one
(``Probe.next_turn``), so the probe's compress-once-ask-many computes what the served path
(``bench.quality_served``: the document as a session's first turn, each question a later turn)
computes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from cache_node.attention_stats import AttentionStats, StatsNeeds
from cache_node.engine import LLMEngine
from cache_node.kv_state import SequenceKV
from cache_node.policies import Policy, make_policy
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence

_ids = itertools.count()


@dataclass
class _Collect(Policy):
    """Reference policy of the probe: keeps everything, records every statistic."""

    name = "_collect"
    needs = StatsNeeds(window_queries=32, attention=True, recent_steps=8)
    compresses = False


class Probe:
    """Prefill/fork/answer helper over one engine (single sequence at a time)."""

    def __init__(self, engine: LLMEngine, chunk_tokens: int = 512) -> None:
        self.engine = engine
        self.pool = engine.pool
        self.block_pool = engine.kv_manager.pool
        self.chunk_tokens = chunk_tokens

    def _run(self, seq: Sequence, n: int) -> torch.Tensor:
        if self.engine.kv_manager.allocate_slots(seq, n) is None:
            raise RuntimeError("quality probe: the KV pool is full; raise kv_pool_bytes")
        logits = self.engine.runner.execute([(seq, n)])
        seq.num_computed_tokens += n
        return logits[0] if len(logits) else torch.empty(0)

    def prefill(self, tokens: list[int]) -> tuple[Sequence, torch.Tensor]:
        """Full-cache prefill with all statistics. Returns (sequence, last logits)."""
        seq = Sequence(f"probe-{next(_ids)}", list(tokens), SamplingParams(max_tokens=4096))
        seq.kv = SequenceKV(seq, _Collect(), self.pool, self.block_pool, self.engine.policy_env,
                            self.engine.host_for_policies)
        logits = torch.empty(0)
        while seq.num_computed_tokens < len(tokens):
            logits = self._run(seq, min(self.chunk_tokens, len(tokens) - seq.num_computed_tokens))
        return seq, logits

    def fork(self, seq: Sequence, policy: Policy | None = None) -> Sequence:
        """An independent copy (own blocks), optionally switching its policy."""
        child = Sequence(f"probe-{next(_ids)}", list(seq.prompt_token_ids), seq.sampling_params)
        child.output_token_ids = list(seq.output_token_ids)
        blocks = self.block_pool.allocate(len(seq.block_table))
        if blocks is None:
            raise RuntimeError("quality probe: the KV pool is full; raise kv_pool_bytes")
        ids = [b.block_id for b in seq.block_table]
        self.pool.write_blocks([b.block_id for b in blocks], self.pool.read_blocks(ids))
        child.block_table = blocks
        child.num_computed_tokens = seq.num_computed_tokens
        child.kv = kv = seq.kv.fork(child, policy)
        if kv.stats is not None:
            kv.stats = _own_stats(kv.stats, kv.policy) if kv.policy.needs.any else None
        return child

    def compress(self, seq: Sequence, spec: str) -> Sequence:
        """Fork ``seq`` under policy ``spec`` and compress it once (question-agnostic).

        Raises:
            RuntimeError: the compressed state lost tokens for want of host-tier room."""
        child = self.fork(seq, make_policy(spec))
        child.kv.after_step()
        _check_kept(child, spec)
        return child

    def teacher_force(self, seq: Sequence, prompt: list[int], forced: list[int], decode: bool = False) -> torch.Tensor:
        """Append ``prompt`` then ``forced`` over the (compressed) context. Returns
        (1 + len(forced), V) logits: the prediction after the prompt and after each forced token.

        ``decode=False``: one chunk (the fast path; the full-cache reference). ``decode=True``:
        the serving path: the prompt as one prefill chunk, then one decode step per forced
        token, with the policy's ``after_step`` (compression, recall) after every step, so a
        recall policy selects per decode step and no policy holds more than its budget.

        Raises:
            RuntimeError: (``decode=True``) the state lost tokens for want of host-tier room."""
        if decode:
            return self._decode_forced(seq, prompt, forced)
        tokens = prompt + forced
        seq.prompt_token_ids = seq.prompt_token_ids + seq.output_token_ids + tokens
        seq.output_token_ids = []
        if self.engine.kv_manager.allocate_slots(seq, len(tokens)) is None:
            raise RuntimeError("quality probe: the KV pool is full; raise kv_pool_bytes")
        logits = self.engine.runner.execute([(seq, len(tokens))], all_logits=True)
        seq.num_computed_tokens += len(tokens)
        seq.kv.after_step()
        return logits[len(prompt) - 1 :]

    @staticmethod
    def next_turn(seq: Sequence) -> None:
        """Start a new turn over ``seq``'s state as ``SessionTable.attach`` does: a compacted
        state continues with its budget recomputed from the new prompt at the turn's end; an
        uncompacted one is attended as plain KV under a fresh policy state."""
        kv = seq.kv
        if kv is None or not kv.policy.compresses:
            return
        if kv.compacted:
            kv.budget = None
        else:
            kv.reset()

    def _decode_forced(self, seq: Sequence, prompt: list[int], forced: list[int]) -> torch.Tensor:
        self.next_turn(seq)
        seq.prompt_token_ids = seq.prompt_token_ids + seq.output_token_ids + prompt
        seq.output_token_ids = []
        out = [self._run(seq, len(prompt))]
        for tok in forced:
            seq.kv.after_step()
            seq.output_token_ids.append(tok)
            out.append(self._run(seq, 1))
        seq.kv.after_step()
        _check_kept(seq, seq.kv.policy.name)
        return torch.stack(out)

    def greedy(self, seq: Sequence, prompt: list[int], max_tokens: int, stop: set[int]) -> list[int]:
        """Greedy answer after ``prompt`` (no forcing)."""
        seq.prompt_token_ids = seq.prompt_token_ids + seq.output_token_ids + prompt
        seq.output_token_ids = []
        logits = self._run(seq, len(prompt))
        out: list[int] = []
        while len(out) < max_tokens:
            seq.kv.after_step()
            tok = int(logits.argmax())
            if tok in stop:
                break
            out.append(tok)
            seq.output_token_ids.append(tok)
            logits = self._run(seq, 1)
        return out

    def release(self, seq: Sequence) -> None:
        self.engine.kv_manager.free(seq)


def _own_stats(stats: AttentionStats, policy: Policy) -> AttentionStats:
    """``stats`` (the probe's, collected for every policy) cut down to what ``policy`` collects
    when it runs the prefill itself: its last ``window_queries`` queries, its decay from now on.

    The cumulative attention was summed without the policy's per-step decay (G-KV's 0.95), so
    under a decaying policy the fork's scores still differ from the served path's."""
    stats.needs, stats.decay = policy.needs, policy.decay
    w = policy.needs.window_queries
    stats.queries = [None if q is None or not w else q[-w:] for q in stats.queries]
    stats.query_pos = [None if p is None or not w else p[-w:] for p in stats.query_pos]
    return stats


def _check_kept(seq: Sequence, spec: str) -> None:
    """Raise RuntimeError when ``seq``'s state lost tokens for want of host-tier room (SentenceKV
    sentences the tier refused): the harness sizes its tier to hold every state it asks of, and
    a row computed without them would measure the tier, not the policy."""
    lost = seq.kv.policy.lost_tokens(seq.kv)
    if lost:
        raise RuntimeError(f"quality probe {spec!r}: the state lost {lost} tokens (host tier full)")
