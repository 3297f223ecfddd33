"""A request as the engine tracks it: tokens, progress, blocks, timing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cache_node.block import KVBlock
from cache_node.sampling_params import SamplingParams


class KeptHistory(Protocol):
    """A session's history KV kept while one of its turns runs from it
    (``cache_node.sessions.SessionKept``)."""

    def lend(self, seq: Sequence) -> bool:
        """Give ``seq`` the history's KV again (after it lost its own); False when it cannot."""

    def num_blocks_beside(self, seq: Sequence) -> int:
        """Pool blocks the kept history holds that ``seq``'s block table does not."""

    def drop(self) -> None:
        """Free the kept history (a ``seq`` that loses its KV then recomputes it all)."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request/sequence.

    Token range diagram (``num_computed_tokens`` = tokens whose KV is in the pool)::

        | prompt_token_ids ............ | output_token_ids ... |
        |<- num_computed_tokens ->|<-- to compute -->|

    Attributes:
        block_table: blocks holding the sequence's KV, in token order (shared by all layers).
        num_cached_tokens: prompt tokens reused from the prefix cache (or a session).
        policy: KV policy spec (``cache_node.policies``); "" = the full cache.
        kv: the policy-managed KV layout (``cache_node.kv_state.SequenceKV``), None when plain.
        num_evicted_tokens: computed tokens no longer occupying a physical slot (compressed
            away); physical slots in use = ``num_computed_tokens - num_evicted_tokens``.
        promoted_from: block hash -> tier ("host", "spill_ram", "spill_disk") of the blocks
            restored from below the device tier for this sequence (per-tier hit counts).
        prefetch_until_s: monotonic time until which the scheduler leaves the sequence queued
            while a prefetch brings its blocks up; 0.0 when none is in flight.
        device_hit_tokens: prompt tokens of a waiting sequence whose KV is on the device tier
            now (set by the scheduler before ordering, for policies with ``orders_by_value``).
        peak_policy_bytes: the most bytes its KV policy held at once outside the pool blocks
            (codes, sentence index, recall region, untiered host RAM; ``SequenceKV``).
        policy_stats: per-request figures its KV policy reports (SentenceKV's recall bound:
            ``recall_bound_max``/``_mean``), passed on in its finished output.
        priority: the request's priority among its own tenant's waiting requests (vLLM's
            ``priority``: lower is served earlier, default 0). It only reorders that tenant's
            requests among the queue positions they hold in the policy's order, stably within
            equal priority; it never moves a request past another tenant's
            (``cache_node.scheduling.base.order_by_priority``).
        prefix_stop: computing stops at this many tokens (no step crosses it), where the
            engine compresses and stores the request's reusable prefix
            (``cache_node.compressed_prefix``); 0 once stored or forked, or when there is none.
        prefix_tokens: the reusable compressed prefix the request named (``prefix_tokens`` of
            ``LLMEngine.add_request``) under a compressing policy, kept for a recomputation
            (``restart``); 0 when none.
        isolate_at: where a step of this sequence failed in the runner with no request named
            (``LLMEngine._recover``): no step in a batch crosses it, and the engine computes
            from it alone; None when no such step is pending.
        kept: a session turn under a compressing policy: its session's history KV, which the
            session keeps while the turn runs, so that a turn that lost its KV (``restart``)
            continues from the history again (``cache_node.sessions``); None otherwise.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    extra_keys: tuple[str, ...] = ()
    session_id: str | None = None
    tenant: str = ""
    policy: str = ""
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[KVBlock] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    arrival_time_s: float = field(default_factory=time.monotonic)
    scheduled_time_s: float | None = None  # its first step's (its queue time ends: vLLM's scheduled_ts)
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    kv: Any = None
    num_evicted_tokens: int = 0
    promoted_from: dict[bytes, str] = field(default_factory=dict)
    prefetch_until_s: float = 0.0
    device_hit_tokens: int = 0
    peak_policy_bytes: int = 0
    policy_stats: dict[str, float] = field(default_factory=dict)
    priority: int = 0
    prefix_stop: int = 0
    prefix_tokens: int = 0
    isolate_at: int | None = None
    kept: KeptHistory | None = None
    continues_state: bool = False  # a session turn under a compressing policy continuing its history's KV
    grammar: Any = None  # its structured output's ``cache_node.grammar_mask.GrammarState``; None: unconstrained
    token_constraints: Any = None  # its ``cache_node.sampler.TokenConstraints``, built on its first constrained step
    # prompt logprobs (``SamplingParams.prompt_logprobs``, ``cache_node.prompt_logprobs``): the
    # prompt positions whose logprobs were taken (0 .. n-1: prompt tokens 1 .. n), and those
    # taken that its next output carries
    prompt_logprobs_done: int = 0
    prompt_logprobs_out: list[Any] = field(default_factory=list)

    @property
    def cache_namespace(self) -> str:
        """The prefix-cache namespace its blocks are hashed under (``extra_keys[0]``; "" for none)."""
        return self.extra_keys[0] if self.extra_keys else ""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is still to compute (up to ``prefix_stop`` while short of it): 1
        for a decode, more for a prefill."""
        return self.compute_end(self.num_computed_tokens) - self.num_computed_tokens

    def compute_end(self, start: int) -> int:
        """Where a step computing from token ``start`` must stop: ``prefix_stop`` while
        ``start`` is short of it, else the end of the tokens; except that a sequence under a
        compressing KV policy recomputing its output tokens (after a preemption) stops at
        the prompt's end, then computes them one per step, as they were decoded.

        Regression: a preempted SnapKV/H2O/... request recomputed its prompt and output
        tokens in one chunk. Its policy compresses after each step, from the queries of that
        step, so it kept other KV than before the preemption and decoded other tokens than
        the same request never preempted.

        A step from short of ``isolate_at`` stops there (the engine runs the step from it
        alone).
        """
        if start < self.prefix_stop:
            end = self.prefix_stop
        elif self.output_token_ids and self.kv is not None and self.kv.policy.compresses:
            end = self.num_prompt_tokens if start < self.num_prompt_tokens else min(start + 1, self.num_tokens)
        else:
            end = self.num_tokens
        if self.isolate_at is not None and start < self.isolate_at:
            end = min(end, self.isolate_at)
        return end

    def chunk_tokens(self, start: int, soft: int, hard: int, step_max: int) -> int:
        """Tokens a step computing from ``start`` takes, given ``soft`` (its share of the step,
        >= 1) and ``hard`` (the most the step can still take, >= ``soft``): ``soft``, except for
        a prompt under a KV policy with a ``prompt_span`` (its attention depends on the step's
        queries), whose chunk ends at a span cut (``Policy.query_spans``: the prompt's length
        less a multiple of the span) or at ``compute_end`` when one is in reach: the last cut
        within ``soft``, else the first within ``hard`` (past ``soft`` by less than a span).
        When none is (a step with fewer than a span's tokens left, or a span longer than
        ``step_max``, the node's ``max_num_batched_tokens``) it takes ``soft`` anyway and
        counts ``policy_stats["prefill_unaligned_chunks"]``: that chunk's recall then depends
        on the chunking. Never 0: a request never waits, nor makes others wait or be
        preempted, for a span (review 21c: waiting for one starved a batch-class turn behind
        interactive decodes, preempted lower classes for tokens, and blocked FCFS admission).

        Regression (hangs review 20 W3): SentenceKV selected a session turn's recalled
        sentences once per prefill chunk, so the same turn decoded other tokens under
        another ``max_num_batched_tokens`` or beside other tenants' requests."""
        span = 0 if self.kv is None else self.kv.policy.prompt_span(self.kv)
        end, p = self.compute_end(start), self.num_prompt_tokens
        if not span or start >= p or start + soft >= end:
            return soft
        cut = start + soft - (start + soft - p) % span  # cuts: p - k * span
        if cut > start:
            return cut - start
        nxt = min(start + ((p - start) % span or span), end)
        if nxt - start <= min(hard, step_max):
            return nxt - start
        self.policy_stats["prefill_unaligned_chunks"] = self.policy_stats.get("prefill_unaligned_chunks", 0.0) + 1
        return soft

    def restart(self) -> None:
        """Its KV is gone (preempted, or its waiting blocks taken): compute again from token
        0, or, for a session turn whose session kept its history's KV (``kept``), from the
        history's end, over that KV as it was when the turn started. A request that named a
        compressed prefix forks it again when the scheduler restarts it while it is stored
        (``Scheduler._fork_prefix``), else stops at the prefix again, where it is compressed
        and stored as its first computation was (``CompressedPrefixCache.store``).

        Regression: a preempted fork of a compressed prefix recomputed its whole prompt and
        compressed it at the prompt's end, with the question seen: it kept other KV and
        decoded other tokens than the same request never preempted.
        """
        self.num_computed_tokens = 0
        # Regression: a preempted session turn under a compressing policy recomputed the whole
        # history with its own prompt, compressed at once, and decoded other tokens than never
        # preempted; it restarts from the history KV its session kept (``kept``).
        if self.kept is not None and self.kept.lend(self):
            return
        if self.continues_state:  # the kept history went (the engine's last resort for blocks):
            # it compresses history and prompt at once now, so it may decode other tokens than
            # never preempted; its usage says so (hangs review 20 N-a: nothing did)
            self.mark_state_dropped()
        if self.prefix_tokens and not self.prefix_stop:
            self.prefix_stop = self.prefix_tokens

    def mark_state_dropped(self) -> None:
        """This session turn computes its history again instead of continuing from the KV its
        session kept (dropped: ``SessionTable.lose``, or taken back while it waited), so it may
        decode other tokens than on a node that kept it: its usage carries
        ``policy_stats["session_state_dropped"]`` (docs/architecture.md, 'Cache node step loop')."""
        self.policy_stats["session_state_dropped"] = 1.0

    @property
    def in_prefill(self) -> bool:
        """True until the whole prompt's KV is computed."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_held_blocks(self) -> int:
        """Pool blocks the sequence holds: its block table plus the blocks charged for what its
        KV policy keeps outside the pool (``SequenceKV.charge_blocks``), plus those of its
        session's history that the session keeps for it (``kept``) beside them."""
        held = len(self.block_table) + (len(self.kv.charge_blocks) if self.kv is not None else 0)
        return held + (self.kept.num_blocks_beside(self) if self.kept is not None else 0)

