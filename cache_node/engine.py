"""The cache node engine: add requests, step, stream outputs, abort.

``LLMEngine`` is this module's intake and step loop with parts mixed in from their own modules:
session calls (``engine_sessions``), memory reclaim (``engine_reclaim``), failed-step recovery
(``engine_recovery``), introspection (``engine_stats``) and tier calls (``tiers.engine_api``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from cache_node import prompt_logprobs
from cache_node.attention_limits import context_limit
from cache_node.compressed_prefix import CompressedPrefixCache, check_prefix_tokens
from cache_node.config import EngineConfig
from cache_node.engine_grammars import NO_TOKENIZER, EngineGrammarsMixin
from cache_node.engine_reclaim import EngineReclaimMixin
from cache_node.engine_recovery import EngineRecoveryMixin
from cache_node.engine_sessions import EngineSessionsMixin
from cache_node.engine_stats import EngineStatsMixin
from cache_node.grammar_stats import GrammarCounters
from cache_node.hashing import HashFn, blake2b_256
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.kv_pool import KVPool, kv_format_name
from cache_node.model_runner import ModelRunner, ScheduledBatch
from cache_node.outputs import InvalidRequestError, PromptLogprob, RequestOutput, TokenLogprobs
from cache_node.policies import PolicyEnv, attach_policy
from cache_node.rope_pin import pin_rope
from cache_node.sampler import draw
from cache_node.sampling_params import SamplingParams
from cache_node.scheduler import Scheduler
from cache_node.sequence import Sequence
from cache_node.sessions import SessionTable
from cache_node.tiers.engine_api import EngineTiersMixin
from cache_node.tiers.manager import TierConfig, TierManager
from cache_node.tiers.spill_api import SpillClient

if TYPE_CHECKING:  # annotations only
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class LLMEngine(EngineSessionsMixin, EngineReclaimMixin, EngineRecoveryMixin, EngineStatsMixin,
                EngineTiersMixin, EngineGrammarsMixin):
    """A model replica over a paged KV pool it owns, with continuous batching.

    Thread-safe for one stepping thread plus callers of ``add_request``/``abort_request``.

    Args:
        model: transformers causal LM; moved to the config's device and dtype (a no-op when
            it is there already, e.g. built there by ``model_loader``).
        config: pool and step sizing, device, dtype and attention backend; the engine keeps
            ``config.resolved()`` (``self.config``: no "auto" left in it).
        model_id: identity of the weights, part of every block hash's extra keys; pass
            ``LoadedModel.model_id`` (a digest of config and weights) so that two different
            models never share cached KV (a name alone is not an identity). The engine's
            ``model_id`` adds the RoPE it fixes for ``max_model_len`` (``rope_pin``), if any.
        eos_token_ids: tokens that end a request unless ``ignore_eos``.
        hash_fn: block-hash digest (tests inject weak ones).
        tier_config: host tier and movement settings (None: no host tier).
        spill: spill-tier client (None: no spill tier); see ``tiers.engine_api`` for tier calls.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig = EngineConfig(),
        model_id: str = "model",
        eos_token_ids: Seq[int] = (),
        hash_fn: HashFn = blake2b_256,
        tier_config: TierConfig | None = None,
        spill: SpillClient | None = None,
    ) -> None:
        mc = model.config
        self.config = config = config.resolved()
        self.vocab_size = mc.vocab_size
        # a sliding window is kept out of reach (the paged attention attends every earlier token)
        self.max_model_len = context_limit(model, config.max_model_len or mc.max_position_embeddings,
                                           config.max_model_len)
        # RoPE whose frequencies follow each forward's longest sequence is fixed for the whole
        # context, and the identity says so (``rope_pin``): a token's KV never depends on its step
        self.model_id = model_id + pin_rope(model, self.max_model_len)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        dtype, device = config.torch_dtype, config.torch_device
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        per_block = config.block_size * KVPool.bytes_per_token(
            mc.num_hidden_layers, mc.num_key_value_heads, head_dim, dtype
        )
        num_blocks = config.kv_pool_bytes // per_block
        if num_blocks < 2:
            raise ValueError(f"kv_pool_bytes={config.kv_pool_bytes} holds fewer than 2 blocks")
        self.pool = KVPool(
            mc.num_hidden_layers, mc.num_key_value_heads, head_dim, config.block_size,
            num_blocks, dtype, device,
        )
        self.kv_format = kv_format_name(config.dtype, mc.num_hidden_layers, mc.num_key_value_heads, head_dim)
        # CUDA-graph decode pads batches to a bucket: the padding writes its K/V into the
        # pool's last block, which the block pool then never hands out
        scratch = ModelRunner.uses_cuda_graphs(config) and num_blocks > 2
        self.kv_manager = KVCacheManager(num_blocks - scratch, config.block_size, hash_fn)
        self.scheduler = Scheduler(config, self.kv_manager)
        self.scheduler.max_seq_tokens = self.max_model_len
        self.scheduler.reclaim = self._reclaim
        self.runner = ModelRunner(model.to(device=device, dtype=dtype), self.pool, config,
                                  (num_blocks - 1) * config.block_size if scratch else None, self.max_model_len)
        self.policy_env = PolicyEnv()  # set from the tokenizer by whoever holds it (SentenceKV)
        self.sessions = SessionTable(self.kv_manager, self._copy_block)
        self.scheduler.session_tenants = self.sessions.tenants
        self.prefixes = CompressedPrefixCache(self.pool, self.kv_manager)
        self.scheduler.prefixes = self.prefixes
        self.requests: dict[str, Sequence] = {}
        self._generating = False  # a ``generate`` call steps this engine (one at a time)
        self._lock = threading.RLock()
        self.tiers = TierManager(self.pool, self.kv_manager, tier_config or TierConfig(), spill, self._lock)
        if self.tiers.enabled:  # preemption may swap a victim's blocks down instead of dropping them
            self.scheduler.attach_swap(self.tiers.demote_free_blocks, self.pool.bytes_per_block)
        # policies that demote KV themselves (SentenceKV) keep it in the host tier when there is one
        self.host_for_policies = self.tiers if self.tiers.host.num_slots else None
        self.tiers.reclaim_host = self._reclaim_host
        self.tiers.host_contenders = self._host_contenders
        if self.scheduler.policy.demotes_over_quota_first:
            self.tiers.demotion_order = self._over_quota_first
        self._aborted: list[Sequence] = []
        self._settling: list[Sequence] = []  # finished session turns whose compaction is due
        self.num_settle_fallbacks = 0  # such turns whose compaction could not run: history unpinned
        self.num_steps = 0
        self.num_failed_requests = 0  # finished with "error" (``_recover``)
        self.num_cut_short = 0  # finished "length" before max_tokens: the pool held no more (``_cut_short``)
        self.num_host_reclaims = 0  # idle policy states dropped for a host reservation
        self._failed_steps = 0  # steps in a row that failed with no policy to blame
        # request id -> computed tokens it reaches by the step that failed in a batch with no
        # request named: that step runs alone (``_recover``, ``Sequence.isolate_at``)
        self._suspects: dict[str, int] = {}
        self._alone = False  # the step running is a suspect's step alone
        # structured outputs (``engine_grammars``): off until ``enable_structured_output``
        self.grammars = None
        self.grammars_off = NO_TOKENIZER
        self.grammar_counters = GrammarCounters()  # the node's grammar_* metrics
        self._compiling: list[Sequence] = []  # waiting requests whose grammar compiles
        self._grammar_active: dict[str, int] = {}  # tenant -> its structured requests here (engine_grammars)
        # what a step passed over became ready (a grammar compiled, a prefetch landed): the
        # cache node sets its wake event here, so a step that scheduled nothing waits for this
        # instead of stepping again at once (``scheduled_nothing``)
        self.on_ready: Callable[[], None] = _nothing
        if self.tiers.worker is not None:
            self.tiers.worker.on_ready = self._ready
        self.scheduled_nothing = False  # the last step ran no batch while requests waited

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop what runs beside the steps, so the engine's memory (KV pool, host tier) is freed
        once it is dropped: the demotion copies in flight land first (CUDA: waited for, their
        blocks released), then the transfer worker's thread ends (``TierManager.close``: queued
        spill puts written within ``timeout_s`` seconds and counted, prefetches dropped), then
        the grammar compiler processes (``close_structured_output``). Returns whether the
        worker's thread ended in time. Call it with no step running and no engine lock held
        (``CacheNode.shutdown`` calls it once its step thread has ended). Idempotent.

        Regression (s39): nothing ended the transfer thread (``kv-transfer``), which waited for
        jobs forever and kept every closed engine's tiers alive."""
        with self._lock:
            self.tiers.release_held(wait=True)
        ended = self.tiers.close(timeout_s)
        self.close_structured_output()
        return ended

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Seq[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_namespace: str | None = None,
        session_id: str | None = None,
        tenant: str = "",
        policy: str = "",
        prefetch: bool | None = None,
        priority: int = 0,
        prefix_tokens: int = 0,
    ) -> str:
        """Queue a request. Returns its id.

        ``prefetch``: start a spill prefetch for it (True), do not (False: e.g. the global
        index saw none of its prefix in spill), or follow ``TierConfig.auto_prefetch`` (None).
        ``priority``: lower is served earlier among the same tenant's waiting requests only
        (``Sequence.priority``).
        ``prefix_tokens``: under a compressing policy, the first that many prompt tokens form a
        reusable document prefix, compressed once and forked by later requests with the same
        prefix, namespace and policy (``cache_node.compressed_prefix``); 0: none.

        Raises:
            InvalidRequestError: empty prompt, token id out of vocabulary, prompt longer than
                the model context, prompt + max_tokens more KV than the whole pool holds
                (under a compressing policy: its prompt, then what it keeps; the message names
                the pool's capacity in tokens), unknown stop token, duplicate id,
                ``prefix_tokens`` not an int in [0, prompt length].
            PermissionError: ``session_id`` belongs to another tenant.
            SessionBusy: ``session_id`` has a turn running.
        """
        params = sampling_params or SamplingParams()
        tokens = [int(t) for t in prompt_token_ids]
        self._validate(tokens, params, request_id)
        check_prefix_tokens(prefix_tokens, len(tokens))
        if prefix_tokens and params.prompt_logprobs is not None:  # a fork computes none of its prefix
            raise InvalidRequestError("prompt_logprobs: not served with prefix_tokens (a reused compressed prefix "
                                      "computes no logits for its tokens); leave one of them unset")
        seq = Sequence(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=tokens,
            sampling_params=params,
            extra_keys=(cache_namespace or self.config.cache_namespace_default, self.model_id, self.kv_format),
            session_id=session_id or None,
            tenant=tenant,
            policy=policy,
            priority=int(priority),
        )
        try:
            attach_policy(seq, self.pool, self.kv_manager.pool, self.policy_env, self.host_for_policies)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        self._check_fits(seq)
        if not params.greedy:
            seq.generator = torch.Generator(device=self.pool.kv.device).manual_seed(
                params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()))
            )
        self._attach_grammar(seq)  # its compilation starts; the scheduler passes it over till done
        with self._lock:
            share = self.scheduler.policy.tenants.get(tenant)
            if share is not None:  # the tiers' fair shares weigh its holder as its tenant
                self.tiers.note_weight(seq.cache_namespace, share.weight, tenant)
            if seq.session_id:
                try:
                    self.sessions.attach(seq)
                except Exception:
                    if seq.grammar is not None:
                        seq.grammar.release()  # its queued compile is nobody's
                        self._uncount_grammar(seq)
                    raise
            self.requests[seq.request_id] = seq
            self.prefixes.admit(seq, prefix_tokens)  # its prefix's KV is taken when it starts
            self.scheduler.add(seq)
            if seq.grammar is not None:
                self._compiling.append(seq)
                seq.grammar.future.add_done_callback(self._ready)
            reuses = self.prefixes.stored_entry(seq) is not None or self.prefixes.computing(seq)
            reuses = reuses or params.prompt_logprobs is not None  # it computes its whole prompt
            if (self.tiers.config.auto_prefetch if prefetch is None else prefetch) and not reuses:
                self.tiers.prefetch(seq, time.monotonic())
        return seq.request_id

    def _ready(self, *_: Any) -> None:
        """A passed-over request may be schedulable now: tell whoever waits (``on_ready``)."""
        self.on_ready()

    def _validate(self, tokens: list[int], params: SamplingParams, request_id: str | None) -> None:
        if not tokens:
            raise InvalidRequestError("prompt is empty")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise InvalidRequestError(f"prompt has token ids outside [0, {self.vocab_size})")
        if len(tokens) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(tokens)} tokens; the model context is {self.max_model_len}"
            )
        pool_tokens = self.scheduler.pool_tokens
        if len(tokens) + 1 > pool_tokens:
            raise InvalidRequestError(f"prompt has {len(tokens)} tokens; the KV pool holds {pool_tokens}")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"unknown stop token ids {bad}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:  # (review 26c F4)
            raise InvalidRequestError(f"logprobs: asks for {params.logprobs} alternatives per token; the "
                                      f"model's vocabulary has {self.vocab_size} tokens")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.vocab_size:
            raise InvalidRequestError(f"prompt_logprobs: asks for {params.prompt_logprobs} alternatives per token; "
                                      f"the model's vocabulary has {self.vocab_size} tokens")
        self._validate_constraints(params)
        if request_id is not None and request_id in self.requests:
            raise InvalidRequestError(f"duplicate request_id {request_id!r}")

    def _validate_constraints(self, params: SamplingParams) -> None:
        """``logit_bias`` and ``allowed_token_ids`` name ids in the vocabulary, and an allowed
        set leaves ``min_tokens`` a token to draw (else every logit of the row is -inf while
        EOS and the stop ids are held off: greedy would pick id 0, sampling fail)."""
        try:
            params.check_vocabulary(self.vocab_size)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        allowed = params.allowed_token_ids
        if allowed is not None and params.min_tokens:
            held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if held.issuperset(allowed):
                raise InvalidRequestError(f"allowed_token_ids: every allowed token ends the request, which min_tokens "
                                          f"({params.min_tokens}) forbids for its first tokens; allow another token")

    def _check_fits(self, seq: Sequence) -> None:
        """Refuse a request whose KV can never fit the pool (it would wedge the queue)."""
        need, pool_tokens = self.scheduler.peak_tokens(seq), self.scheduler.pool_tokens
        if need > pool_tokens:
            params = seq.sampling_params
            under = f" under KV policy {seq.policy!r} (with what it keeps outside the pool)" if seq.kv is not None else ""
            raise InvalidRequestError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{need} tokens of KV at once{under}; this node's KV pool holds {pool_tokens} tokens"
            )

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request at the next step boundary and free its blocks. False if unknown.

        ``reason``: its finish reason; "stop" ends it as a completed request (the cache node
        matched a stop string in its text): a session keeps its tokens as history, which an
        "abort" drops, and takes no next turn until the next step reports this end
        (``SessionTable.hold_until_reported``: the node cuts the history then)."""
        with self._lock:
            seq = self.requests.get(request_id)
            if seq is None or seq.is_finished:
                return False
            self._finish(seq, reason)
            self._aborted.append(seq)
            self._settle_finished_turns()
            if seq.session_id is not None and reason not in ("abort", "rejected", "error"):
                self.sessions.hold_until_reported(seq)
            return True

    def forget_tenant(self, tenant: str) -> None:
        """Drop what the scheduling policy and the tiers' holder weights keep of ``tenant``
        (``SchedulingPolicy.forget_tenant``, ``HolderWeights.forget_tenant``): its tenant was
        deleted and none of its requests is left here (``services.cache_node_commands``), so a
        churn of tenants registered and deleted leaves nothing behind. Regression (s37): its
        share, VTC counter, rate window and weight entries stayed for good."""
        with self._lock:
            self.scheduler.policy.forget_tenant(tenant)
        self.tiers.weights.forget_tenant(tenant)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    # ---- the step loop --------------------------------------------------------------------
    def step(self, on_scheduled: Callable[[ScheduledBatch], None] | None = None) -> list[RequestOutput]:
        """Run one iteration: schedule, forward, sample, stream increments.

        Args:
            on_scheduled: called with the batch after scheduling and before the forward pass
                (the cache node announces newly started requests while the step computes).
        """
        with self._lock:
            self.release_undo()  # the cache node undid (``rewind_session``) what it had to
            outputs = [self._output(s, ()) for s in self._aborted]
            for seq in self._aborted:  # reported: their sessions take a next turn again
                self.sessions.reported(seq)
            self._aborted = []
            self._poll_grammars(outputs)  # a grammar that failed to compile refuses its request
            for seq in self.scheduler.take_rejected():  # can never fit the pool
                if seq.output_token_ids:
                    self._cut_short(seq)
                self._finish(seq, "length" if seq.output_token_ids else "rejected")
                outputs.append(self._output(seq, ()))
            self._settle_finished_turns()  # (and any a failed step left)
            self._release_idle_sessions()
            self.tiers.maybe_demote()
            batch = self._schedule()
            if batch:
                now = time.monotonic()
                for seq, _ in batch:
                    if seq.scheduled_time_s is None:  # (a preempted request keeps its first)
                        seq.scheduled_time_s = now
                if on_scheduled is not None:
                    on_scheduled(batch)
                try:
                    self._execute(batch, outputs)
                except Exception as exc:  # noqa: BLE001 - _recover logs it, re-raises repeats
                    self._recover(batch, exc, outputs)
                else:
                    self._failed_steps = 0
                self.scheduled_nothing = False
                return outputs
            waiting = bool(self.scheduler.waiting)
            # nothing runs and every waiting request was passed over (its grammar compiles,
            # its prefetch is in flight, its blocks are held by a demotion copy)
            self.scheduled_nothing = waiting and not outputs and not self.scheduler.running
        if waiting:  # e.g. every queued request waits on a prefetch: let it land
            time.sleep(0.0005)
        return outputs

    def _execute(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> None:
        todo = prompt_logprobs.spans(batch)  # (SamplingParams.prompt_logprobs)
        prompts = prompt_logprobs.PromptLogprobsStep(self.runner.model.lm_head, todo) if todo else None
        logits = self.runner.execute(batch, on_hidden=prompts)  # one row per sequence reaching its last token
        rows = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens]
        faulted = []
        for seq, n in batch:
            seq.num_computed_tokens += n
            try:
                self._after_forward(seq)
            except Exception:  # this sequence's policy failed: it alone fails (SequenceFault)
                log.exception("request %s: its step failed after the forward pass", seq.request_id)
                faulted.append(seq)
        if faulted:
            keep = [i for i, seq in enumerate(rows) if seq not in faulted]
            logits, rows = logits[keep], [rows[i] for i in keep]
            for seq in faulted:
                self._fail(seq, outputs)
        logits, rows = self._constrain(logits, rows, outputs)  # the grammars' masks (structured outputs)
        failed: list[int] = []  # a failed draw fails its request alone; the others keep theirs
        tokens, logprobs = draw(logits, rows, failed, self.eos_token_ids)
        for i in failed:
            log.error("request %s: its token could not be drawn (sampling failed)", rows[i].request_id)
            self._fail(rows[i], outputs)
        # a token's time is when the step hands it out: after the policies' compression
        # (``after_step``) and the sampling, which a caller waits for as well
        now = time.monotonic()
        mid_prompt = prompts.commit() if prompts is not None else []  # (after the draw's host sync)
        drawn = [row for i, row in enumerate(zip(rows, tokens, logprobs)) if i not in failed]
        for seq, token, lp in drawn:
            seq.output_token_ids.append(token)
            seq.first_token_time_s = seq.first_token_time_s or now
            seq.last_token_time_s = now
            reason = self._grammar_reason(seq, token) or self._stop_reason(seq, token)
            if reason:
                self._finish(seq, reason)
            outputs.append(self._output(seq, (token,), () if lp is None else (lp,)))
        # a mid-prompt chunk's prompt logprobs go out with no token (a request failed this step has ended)
        outputs.extend(self._output(seq, ()) for seq in mid_prompt if seq.prompt_logprobs_out and not seq.is_finished)
        self.num_steps += 1
        self._settle_finished_turns()  # after every row's output: preempting one is safe now

    def _after_forward(self, seq: Sequence) -> None:
        """One sequence's bookkeeping after the forward pass: cache its full blocks, let its
        policy compress, store a compressed prefix it reached."""
        if seq.kv is None or not seq.kv.compacted:  # compacted blocks are never cached
            self.kv_manager.cache_full_blocks(seq)
        if seq.kv is not None:
            seq.kv.after_step()
        if seq.prefix_stop and seq.num_computed_tokens == seq.prefix_stop:
            self._store_prefix(seq)

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy pool block ``src``'s KV (every layer, K and V: ``block_size`` slots) into block
        ``dst``, on the compute stream (a freshly allocated ``dst`` whose demotion is still in
        flight is ordered by ``BlockPool.evict_hook``). ``SessionTable._seal``'s copy of a
        history's partial block."""
        self.pool.write_blocks([dst], self.pool.read_blocks([src]))

    def _store_prefix(self, seq: Sequence) -> None:
        """``seq`` reached its prefix boundary: compress the prefix and store it (the requests
        waiting for it fork it when the scheduler starts them). A compression put off for want
        of free blocks keeps ``seq`` at its boundary; the scheduler runs this again before its
        next step (``SequenceKV.retry``)."""
        self.prefixes.store(seq)
        if seq.kv is not None and seq.kv.compaction_due and seq.prefix_stop:
            seq.kv.retry = lambda: self._store_prefix(seq)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling_params
        stoppable = len(seq.output_token_ids) > params.min_tokens  # (the sampler masks them before)
        if stoppable and ((token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq)
        if seq.grammar is not None:
            seq.grammar.release()  # aborted while compiling: a compile only it waits on is dropped
            self._uncount_grammar(seq)
        self.prefixes.on_finish(seq)  # those waiting for its prefix's computation go on
        seq.finish_reason = reason
        # a session keeps the turn's blocks, with its policy state when a policy compacted them
        # (the next turn of that policy continues from it: cache_node.sessions)
        dropped = reason in ("abort", "rejected", "error")
        if seq.session_id is not None and not dropped and seq.kv is not None and seq.kv.compaction_due:
            self._settling.append(seq)  # its compaction runs first (``_settle_finished_turns``)
        else:
            self._hand_over(seq, dropped)
        self.requests.pop(seq.request_id, None)

    def _output(self, seq: Sequence, new: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...] = ()) -> RequestOutput:
        ttft = None if seq.first_token_time_s is None else seq.first_token_time_s - seq.arrival_time_s
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            ttft_s=ttft,
            output_token_ids=tuple(seq.output_token_ids) if seq.is_finished else (),
            num_cached_tokens_by_tier=self.tiers.cached_tokens_by_tier(seq),
            policy_bytes=seq.peak_policy_bytes,
            policy_stats=dict(seq.policy_stats) if seq.is_finished else {},
            phase_s=_phases(seq) if seq.is_finished else {},
            grammar_wait_s=seq.grammar.wait_s(seq.arrival_time_s) if seq.grammar is not None else None,
            logprobs=logprobs,
            prompt_logprobs=self._take_prompt_logprobs(seq),
        )

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> tuple[PromptLogprob, ...]:
        """The prompt logprobs ``seq`` took that no output carried yet (``cache_node.prompt_logprobs``)."""
        out = tuple(seq.prompt_logprobs_out)
        seq.prompt_logprobs_out.clear()
        return out

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
        **kw: Any,
    ) -> list[RequestOutput]:
        """Run prompts to completion as one continuous batch, stepping this engine on the
        calling thread; final outputs in prompt order. Requests added otherwise run along and
        their outputs are dropped (``step`` is theirs to call). When it raises (a prompt refused
        after others were added, a failed step, an interrupt), its requests not finished are
        aborted: none runs on unseen.

        Raises:
            RuntimeError: another ``generate`` steps this engine (the two would take each
                other's outputs: one waited for ever for an output the other dropped).
            InvalidRequestError: a prompt or its params are refused (``add_request``).

        Regression (s40): each step's finished outputs were all taken as this call's, so one of
        another request (a concurrent call's, or one a failed call left running) ended the call
        early with a KeyError, and a failed call's requests ran on in the engine."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        with self._lock:
            if self._generating:
                raise RuntimeError("another generate call steps this engine: one at a time")
            self._generating = True
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for prompt, sp in zip(prompts, plist):
                ids.append(self.add_request(prompt, sp, **kw))
            mine = set(ids)
            while len(final) < len(ids):
                final.update((out.request_id, out) for out in self.step() if out.finished and out.request_id in mine)
            return [final[i] for i in ids]
        except BaseException:
            for rid in ids:
                if rid not in final:
                    self.abort_request(rid)
            raise
        finally:
            self._generating = False


def _nothing() -> None:
    """``LLMEngine.on_ready`` until a cache node sets it."""


def _phases(seq: Sequence) -> dict[str, float]:
    """A finished request's phases, s, as vLLM's request histograms time them: ``queue``
    (arrival to its first step), ``prefill`` (first step to first token), ``decode`` (first
    to last token), ``inference`` (first step to last token: prefill + decode); empty when it
    drew no token (never scheduled, or ended before its first token)."""
    scheduled, first, last = seq.scheduled_time_s, seq.first_token_time_s, seq.last_token_time_s
    if scheduled is None or first is None or last is None:
        return {}
    return {"queue": scheduled - seq.arrival_time_s, "prefill": first - scheduled, "decode": last - first,
            "inference": last - scheduled}
