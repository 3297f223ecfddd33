"""A request's grammar while it decodes: its state (``GrammarState``: the compilation, then the
matcher) and the step's mask (``constrain``).

Each step, for the rows that have a matcher only, ``constrain`` fills their rows of one host
bitmask (xgrammar's ``fill_next_token_bitmask``), copies it to the logits' device and sets
every token the grammar does not allow to -inf there (``apply_token_bitmask_inplace``); after
the draw the engine feeds each constrained row its token (``cache_node.engine_grammars``). A
step with no constrained row does nothing of this. Compiling is ``cache_node.grammars``'.

The matcher's work runs on the step thread, so it is bounded per row and step: its fill plus
its last ``accept_token``, measured in CPU time of this thread (``time.thread_time``: a thread
descheduled on a busy host is not charged), past ``grammar_step_budget_ms`` refuses the request
(an ambiguous grammar's Earley matcher can take tens of milliseconds a step and more with each
token; a normal grammar takes ~10-50 us), and per request: its matcher time summed over its
steps past ``grammar_request_budget_ms`` refuses it too. That sum is also what bounds the
matcher's memory: xgrammar (0.2.9) keeps every input byte's parser states for rollback for the
matcher's whole life (``max_rollback_tokens`` is deprecated, always unlimited) and exposes no
size of them, and a grammar can stay far under the step budget while its history grows by tens
of KB a token (measured: 256 ``[a-z]*`` in a row, 0.23 ms and ~26-41 KB a token, ~200-330 MB
over 8,192 tokens). Building a state costs matcher time, so the history grows at most as fast
as the matcher works: at most ~190 MB per CPU second in the worst grammars measured (JSON
~100, ambiguous ones 4-25), so a request's matcher holds at most ~0.2 MB per ms of
``grammar_request_budget_ms`` (~200 MB at the default 1,000 ms; a JSON schema's matcher takes
~4 us and ~0.4 KB a token). Every constrained row's host bitmask is checked for a
row with nothing to draw (a few microseconds) before the mask reaches the device.

The order of the logits steps is vLLM V1's: the grammar mask is applied to the model's logits
before the sampler (``vllm.v1.worker.gpu_model_runner``), so its log probabilities
(``raw_logprobs``) are those of the masked distribution: a token the grammar forbids has
log probability -inf. Everything else (``allowed_token_ids``, ``logit_bias``, penalties,
``min_tokens``, temperature, min-p, top-k, top-p) comes after, on the allowed tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from cache_node.grammar_compile import GrammarUnavailable
from cache_node.grammars import Grammars
from cache_node.structured_output import StructuredOutputSpec

log = logging.getLogger(__name__)


class GrammarState:
    """One request's grammar: its compilation, then its matcher (the grammar's state after
    every output token so far; fed each token once, when it is appended to the output, so a
    preempted request, recomputed or swapped, continues from the same state)."""

    def __init__(self, grammars: Grammars, spec: StructuredOutputSpec, tenant: str = "", namespace: str = "") -> None:
        """Raises ``GrammarQueueFull`` (``Grammars.compile``)."""
        self.grammars = grammars
        self.spec = spec
        self.tenant = tenant  # whose compile queue and ``grammar_max_active_per_tenant`` it counts in
        self.namespace = namespace  # its request's cache namespace: whose grammars it may share
        self.counted = False  # counted in its tenant's active structured requests (the engine's)
        self.future = grammars.compile(spec, tenant, namespace)
        # when its compile ended (monotonic s; None: not yet): at once for a grammar its
        # namespace has compiled, else from the compiler's thread (``wait_s``)
        self.compiled_s: float | None = None
        self.future.add_done_callback(self._compiled)
        self.matcher: Any = None
        self.error: str | None = None
        self.error_code = ""  # with ``error``: the status a node-side failure takes ("": INVALID_ARGUMENT)
        self.retry_after_s = 0.0  # with ``error_code``: the retry hint, s
        self._released = False
        self.num_accepted = 0  # tokens fed to the matcher (this turn's output tokens)
        self.accept_s = 0.0  # the last ``accept_token``'s CPU time (counted in the next step's budget)
        self.total_s = 0.0  # matcher CPU time charged so far (``grammar_request_budget_ms``)
        self.refusal = ""  # why ``constrain`` refused it (``grammar_stats.REFUSAL_REASONS``)

    def _compiled(self, _: Any) -> None:
        if self.compiled_s is None:
            self.compiled_s = time.monotonic()

    def wait_s(self, arrival_s: float) -> float | None:
        """Seconds from ``arrival_s`` (its request's arrival, monotonic) until its compile ended
        (>= 0): how long its grammar held its request back, the tenant's spec's cost rather than
        the node's pace (the scheduler's ``NodePace`` takes it out of its request's TTFT). None
        while it compiles."""
        return None if self.compiled_s is None else max(0.0, self.compiled_s - arrival_s)

    def release(self) -> None:
        """Its request ended: it waits on its compilation no more (``Grammars.release``: a queued
        compile no other request waits on is dropped). Idempotent; nothing once it compiled."""
        if not self._released and not self.future.done():
            self._released = True
            self.grammars.release(self.spec, self.future, self.namespace)

    @property
    def ready(self) -> bool:
        """Its matcher exists (the request may be scheduled)."""
        return self.matcher is not None

    def poll(self) -> bool:
        """Whether the compilation ended; then ``matcher`` or ``error`` is set."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        self._compiled(None)  # (its callback may be yet to run in the thread that finished it)
        if self.future.cancelled():  # dropped: every request waiting on it was released
            self.error = "structured_output: its compile was dropped (its request ended)"
            return True
        exc = self.future.exception()
        if exc is not None:
            self.error = str(exc) if isinstance(exc, ValueError) else f"structured_output: {type(exc).__name__}: {exc}"
            if isinstance(exc, GrammarUnavailable):  # the node's fault: a retry may compile it
                self.error_code, self.retry_after_s = exc.code, exc.retry_after_s
        else:
            try:  # (``Grammars`` built one of this grammar already: a failure here is the node's)
                self.matcher = self.grammars.matcher(self.future.result())
            except Exception as exc:  # noqa: BLE001 - this request alone is refused, never the step
                log.error("structured_output: a compiled grammar could not make a matcher: %s: %s",
                          type(exc).__name__, exc)
                self.error = "structured_output: the compiled grammar could not be used (see the cache node's log)"
                self.error_code = "INTERNAL"  # the node's fault, not the request's
        return True


def _bits(ids: Collection[int], words: int) -> np.ndarray:
    """A (words,) uint32 bitmask with the bits of ``ids`` (those under ``words * 32``) set."""
    out = np.zeros(words, dtype=np.uint32)
    index = np.fromiter((t for t in ids if 0 <= t < words * 32), dtype=np.int64)
    np.bitwise_or.at(out, index >> 5, np.left_shift(np.uint32(1), (index & 31).astype(np.uint32)))
    return out


def constrain(grammars: Grammars, logits: torch.Tensor, states: list[GrammarState | None],
              held: list[Collection[int]], allowed: list[Collection[int] | None],
              budget_s: float = float("inf"), total_budget_s: float = float("inf"),
              ) -> tuple[list[int], dict[int, str]]:
    """Mask each constrained row of ``logits`` (num_rows, vocab), in place, to its grammar.

    Args:
        states: per row, its ``GrammarState`` (ready) or None (unconstrained: untouched).
        held: per row, the token ids ``min_tokens`` holds back this step (empty when none).
        allowed: per row, its ``allowed_token_ids`` (None: all).
        budget_s: the most matcher time (CPU seconds of this thread: its fill now plus its
            last ``accept_token``, ``GrammarState.accept_s``) one row may take in one step.
        total_budget_s: the most matcher time one row may take over all its steps
            (``GrammarState.total_s``, this step's included).

    Returns:
        ``(complete, refused)``. ``complete``: the constrained rows with no token that the
        grammar, ``held`` and ``allowed`` all let through, whose grammar may end here (it
        allows its stop token, which ``min_tokens`` holds back: the output is complete).
        ``refused``: row -> why (a message naming ``structured_output``): rows past
        ``budget_s`` or ``total_budget_s``, and rows with nothing to draw otherwise (the grammar allows no token at
        all, or none of those ``allowed_token_ids`` leave; their masked logits would be all
        -inf: greedy would take token 0, and a NaN draw on a GPU is fatal). Checked on the host
        bitmask, every constrained row (a few microseconds): no device sync.
    """
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return [], {}
    bitmask = grammars.bitmask
    complete: list[int] = []
    refused: dict[int, str] = {}
    for i in rows:
        state = states[i]
        start = time.thread_time()
        state.matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
        spent = time.thread_time() - start + state.accept_s  # type: ignore[union-attr]
        state.total_s = total = state.total_s + spent  # type: ignore[union-attr]
        if spent > budget_s:
            state.refusal = "step_budget"  # type: ignore[union-attr]
            refused[i] = (f"structured_output: its grammar took {spent * 1e3:.1f} ms of matcher time in one step, "
                          f"past this node's limit of {budget_s * 1e3:g} ms (grammar_step_budget_ms); use a less "
                          "ambiguous grammar (e.g. no nested or left-recursive repetition)")
        elif total > total_budget_s:
            state.refusal = "request_budget"  # type: ignore[union-attr]
            n = state.num_accepted  # type: ignore[union-attr]
            refused[i] = (f"structured_output: its grammar took {total * 1e3:.1f} ms of matcher time over {n} output "
                          f"tokens, past this node's limit of {total_budget_s * 1e3:g} ms "
                          "per request (grammar_request_budget_ms); use a less ambiguous grammar (fewer "
                          "alternatives or repetitions that stay open) or fewer max_tokens")
    table = bitmask.numpy().view(np.uint32)  # (the same memory: no copy)
    empty = ~table[rows].any(axis=1)  # one pass over every constrained row's words
    for i, grammar_empty in zip(rows, empty.tolist()):
        if i in refused or not (grammar_empty or held[i] or allowed[i] is not None):
            continue
        grammar = table[i]
        words = grammar & ~_bits(held[i], grammar.shape[0])
        if allowed[i] is not None:
            words &= _bits(allowed[i], grammar.shape[0])  # type: ignore[arg-type]
        if not words.any():
            n = states[i].num_accepted  # type: ignore[union-attr]
            if grammar_empty:
                refused[i] = (f"structured_output: the grammar allows no token after {n} output tokens "
                              "(it cannot complete)")
            elif (grammar & _bits(grammars.stop_token_ids, grammar.shape[0])).any():
                complete.append(i)
            else:
                refused[i] = (f"structured_output: the grammar allows none of the tokens allowed_token_ids "
                              f"leaves after {n} output tokens")
    mask = bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
    grammars.xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=grammars.vocab_size, indices=rows)
    return complete, refused
