"""``LLMEngine``'s structured outputs: a request's grammar from arrival to its last token.

- ``add_request``: a request with ``SamplingParams.structured_output`` gets a
  ``GrammarState`` whose compilation is queued for its tenant (``seq.tenant``, else its cache
  namespace) on ``Grammars``' compiler processes, unless its cache namespace has it compiled or
  compiling already (grammars are shared within a cache namespace only, as prefix KV is:
  ``grammars.grammar_key``); it is queued, but the scheduler passes it
  over (it holds no KV) until its matcher exists. A node whose structured outputs are off (no
  tokenizer, or xgrammar not installed) refuses it at once (``InvalidRequestError`` naming
  ``structured_output``), as it does one whose tenant has ``grammar_compile_queue_per_tenant``
  compiles pending (``GrammarQueueFull``, a retryable refusal), or
  ``grammar_max_active_per_tenant`` structured requests here already, queued, compiling or
  decoding (``GrammarActiveFull``, retryable too: one tenant cannot fill every row of a step
  with grammar work). Each refusal comes before anything is held (no compile queued, no
  block, no matcher); a request counts from its queuing to its ``_finish``
  (``_grammar_active``).
  When its compile ends is kept (``GrammarState.compiled_s``): its outputs carry its wait
  from arrival (``RequestOutput.grammar_wait_s``, the tenant's spec's cost, part of its TTFT),
  which its ``finished`` event reports as ``grammar_wait_ms`` for the scheduler's admission
  pace (``NodePace.finished`` takes it out).
- each step, first: the compilations that ended are polled (``_poll_grammars``); one that
  failed (the compiler's message, or past ``grammar_compile_timeout_s``) finishes its request
  "rejected" with that message (``RequestOutput.error``: the node answers INVALID_ARGUMENT),
  with nothing held; so does one whose matcher cannot be built ("could not be used", the
  node's fault, logged), and one whose poll raises anything else ends "error" (INTERNAL) alone:
  no request's grammar can end the step loop. An abort while it compiles finishes it like any waiting request
  (``_finish`` releases its ``GrammarState``): a compilation still queued that no other
  request waits on is dropped, freeing its tenant's slot at once; a running one ends on its
  process and is cached. So is one whose request ``add_request`` refuses after queuing it
  (``SessionBusy``).
- before the draw (``_constrain``): the constrained rows' logits are masked to their grammars
  (``grammar_mask.constrain``). A row left with nothing to draw (every token -inf: the grammar
  allows none of what ``min_tokens`` and ``allowed_token_ids`` leave) is never drawn (greedy
  would take token 0; a NaN draw fails, on a GPU fatally): when its grammar may end there
  (e.g. it allows only EOS, which ``min_tokens`` holds back) it finishes "stop", short of
  ``min_tokens``, its output complete (the grammar wins: any other token would break it); else
  (a grammar with a dead end, e.g. ``root ::= "a" b`` / ``b ::= b "c"``, or
  ``allowed_token_ids`` disjoint from it) it finishes "rejected" with a message naming
  ``structured_output`` (INVALID_ARGUMENT: the client's spec, not a node failure), no token
  drawn. So does a row whose matcher work in one step (its fill plus its last
  ``accept_token``, CPU time) passes ``grammar_step_budget_ms``: an ambiguous grammar whose
  matcher slows with every token would hold every tenant's step; its blocks are freed. So
  does one whose matcher time over all its steps passes ``grammar_request_budget_ms``, which
  bounds the matcher's memory too (``cache_node.grammar_mask``).
- after the draw (``_grammar_reason``): the token is fed to its matcher once, when it joins the
  output. A matcher that terminates (it accepted EOS) ends the request "stop", with
  ``ignore_eos`` too (nothing may follow a complete grammar). A token the matcher refuses
  cannot follow from the mask; should it, the request finishes "error" (logged, counted in
  ``num_failed_requests``), never with a broken output marked complete.

Everything else stays as without a grammar: ``max_tokens`` ends it "length" (the output may be
incomplete, as in vLLM), a stop string or stop token the grammar allows ends it "stop", and a
session turn's grammar applies to that turn's output only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from cache_node.grammar_mask import GrammarState, constrain
from cache_node.grammar_stats import GrammarCounters
from cache_node.grammars import CompileLimits, Grammars
from cache_node.outputs import GrammarActiveFull, InvalidRequestError, RequestOutput
from cache_node.sequence import Sequence

if TYPE_CHECKING:
    from cache_node.engine import LLMEngine

log = logging.getLogger(__name__)

NO_TOKENIZER = "this cache node cannot constrain output: it has no tokenizer (structured_output needs one)"


class EngineGrammarsMixin:
    grammars: Grammars | None
    grammars_off: str  # why ``grammars`` is None
    grammar_counters: GrammarCounters  # every ``Grammars`` this engine made counts here
    _compiling: list[Sequence]
    _grammar_active: dict[str, int]

    def enable_structured_output(self: LLMEngine, tokenizer: Any) -> bool:
        """Serve ``structured_output`` requests with ``tokenizer``'s vocabulary (the cache node
        calls it with the model's tokenizer). False, with ``grammars_off`` saying why, when
        xgrammar is not installed."""
        cfg = self.config
        limits = CompileLimits(timeout_s=cfg.grammar_compile_timeout_s, workers=cfg.grammar_compile_workers,
                               queue_per_tenant=cfg.grammar_compile_queue_per_tenant,
                               cache_bytes=cfg.grammar_cache_bytes, worker_memory_bytes=cfg.grammar_worker_memory_bytes)
        made = Grammars.create(tokenizer, self.vocab_size, self.eos_token_ids, cfg.max_num_seqs, limits,
                               self.grammar_counters)
        if isinstance(made, str):
            self.grammars_off = made
            log.warning("%s", made)
            return False
        if self.grammars is not None:
            self.grammars.close()
        self.grammars = made
        return True

    def close_structured_output(self: LLMEngine) -> None:
        """Stop the grammar compiler processes (waiting compiles fail, running ones are killed,
        every process reaped); structured requests are refused from then on. Also done when the
        engine is collected and at interpreter exit; a killed node's processes end with it
        (``cache_node.grammar_worker``)."""
        if self.grammars is not None:
            self.grammars.close()
        self.grammars = None
        self.grammars_off = "this cache node's structured outputs were closed"

    def grammar_stats(self: LLMEngine) -> dict[str, Any]:
        """What the node's grammar compiling did and holds, for its metrics (read at scrape
        time, never waiting for a step): ``Grammars.stats`` while structured outputs are on;
        else the counts so far (``GrammarCounters.snapshot``), nothing queued, running or kept."""
        grammars = self.grammars
        if grammars is not None:
            return grammars.stats()
        return self.grammar_counters.snapshot() | {
            "compiles_queued": 0, "compiles_running": 0, "compiler_processes": 0, "cache_entries": 0,
            "cache_bytes": 0, "failed_specs": 0}

    def _attach_grammar(self: LLMEngine, seq: Sequence) -> None:
        """Start compiling ``seq``'s grammar (add_request; ``InvalidRequestError`` when off)."""
        spec = seq.sampling_params.structured_output
        if spec is None:
            return
        if self.grammars is None:
            raise InvalidRequestError(f"structured_output: {self.grammars_off}")
        tenant = seq.tenant or seq.cache_namespace
        cap = self.config.grammar_max_active_per_tenant
        with self._lock:  # checked and counted at once: ``add_request`` may come from several threads
            active = self._grammar_active.get(tenant, 0)
            if active >= cap:
                self.grammar_counters.refused("active_full")
                raise GrammarActiveFull(
                    f"structured_output: this tenant already has {cap} structured-output requests on this cache "
                    "node (grammar_max_active_per_tenant); retry when one of them finishes")
            seq.grammar = GrammarState(self.grammars, spec, tenant, seq.cache_namespace)  # (may raise GrammarQueueFull)
            self._grammar_active[tenant] = active + 1
            seq.grammar.counted = True

    def forget_tenant_grammars(self: LLMEngine, tenant: str, namespace: str) -> int:
        """The deleted tenant ``tenant``'s grammars go (``Grammars.forget``: those of its own
        ``namespace``, salted variants too, its claims, failed specs and queued compiles), as its
        KV does (``services.cache_node_commands.end_tenant``); returns the cache entries dropped."""
        grammars = self.grammars
        return grammars.forget(tenant, namespace) if grammars is not None else 0

    def _uncount_grammar(self: LLMEngine, seq: Sequence) -> None:
        """``seq`` finished (or was refused after ``_attach_grammar``): it counts no more in its
        tenant's ``grammar_max_active_per_tenant`` (once, whatever path ended it)."""
        with self._lock:
            if not seq.grammar.counted:
                return
            seq.grammar.counted = False
            tenant = seq.grammar.tenant
            left = self._grammar_active[tenant] - 1
            if left:
                self._grammar_active[tenant] = left
            else:
                del self._grammar_active[tenant]

    def _poll_grammars(self: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Step start: forget finished requests' compilations, refuse those that failed."""
        if not self._compiling:
            return
        pending = []
        for seq in self._compiling:
            if seq.is_finished:
                continue
            try:
                if not seq.grammar.poll():
                    pending.append(seq)
                elif seq.grammar.error is not None:
                    self._finish(seq, "rejected")
                    outputs.append(dataclasses.replace(self._output(seq, ()), error=seq.grammar.error,
                                                       error_code=seq.grammar.error_code,
                                                       retry_after_s=seq.grammar.retry_after_s))
            except Exception:  # one request's failure ends it alone, never the step loop
                log.exception("request %s: its grammar could not be polled", seq.request_id)
                self.num_failed_requests += 1
                if not seq.is_finished:
                    self._finish(seq, "error")
                    outputs.append(self._output(seq, ()))
        self._compiling = pending

    def _constrain(self: LLMEngine, logits: torch.Tensor, rows: list[Sequence],
                   outputs: list[RequestOutput]) -> tuple[torch.Tensor, list[Sequence]]:
        """``logits`` of ``rows`` masked to their grammars (in place); rows with nothing left to
        draw are finished "stop" and taken out. Free when no row has a grammar."""
        states = [seq.grammar for seq in rows]
        if self.grammars is None or not any(s is not None for s in states):
            return logits, rows
        held = [self._held_back(seq) if s is not None else () for seq, s in zip(rows, states)]
        allowed = [seq.sampling_params.allowed_token_ids for seq in rows]
        cfg = self.config
        complete, refused = constrain(self.grammars, logits, states, held, allowed, cfg.grammar_step_budget_ms / 1e3,
                                      cfg.grammar_request_budget_ms / 1e3)
        if not (complete or refused):
            return logits, rows
        for i in complete:
            self._finish(rows[i], "stop")
            outputs.append(self._output(rows[i], ()))
        for i, why in refused.items():  # the client's spec: INVALID_ARGUMENT, nothing drawn
            log.info("request %s refused: %s", rows[i].request_id, why)
            self.grammar_counters.refused(rows[i].grammar.refusal or "no_token")
            self._finish(rows[i], "rejected")
            outputs.append(dataclasses.replace(self._output(rows[i], ()), error=why))
        keep = [i for i in range(len(rows)) if i not in complete and i not in refused]
        return logits[keep], [rows[i] for i in keep]

    def _held_back(self: LLMEngine, seq: Sequence) -> frozenset[int]:
        """Tokens ``min_tokens`` holds back from ``seq`` this step (the sampler's mask)."""
        params = seq.sampling_params
        if len(seq.output_token_ids) >= params.min_tokens:
            return frozenset()
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)

    def _grammar_reason(self: LLMEngine, seq: Sequence, token: int) -> str | None:
        """Feed ``token`` (just appended to ``seq``'s output) to its matcher: "stop" when the
        grammar is complete, "error" when it refuses the token, else None."""
        if seq.grammar is None:
            return None
        matcher = seq.grammar.matcher
        start = time.thread_time()
        accepted = matcher.accept_token(token)
        seq.grammar.accept_s = time.thread_time() - start  # counted in the next step's budget
        seq.grammar.num_accepted += 1
        if not accepted:
            log.error("request %s: its grammar refused token %d drawn under its mask", seq.request_id, token)
            self.num_failed_requests += 1
            return "error"
        return "stop" if matcher.is_terminated() else None
