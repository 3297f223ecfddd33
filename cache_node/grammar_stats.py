"""What the node's grammar compiling did, counted for its Prometheus metrics
(``services.metrics.node``: ``grammar_*``).

``GrammarCounters`` is owned by the engine and handed to each ``Grammars`` it makes, so its
counts run on across a ``Grammars`` closed and made again (a counter never goes back). Every
compile queued ends once, with one of ``COMPILE_RESULTS`` (``Grammars._finish``, or
``Grammars.release`` for one dropped from the queue; one still queued when the node shuts down
is failed by ``grammar_compile.stop`` and counted nowhere); each one that ran on a compiler process
is observed in the compile-time histogram (``COMPILE_SECONDS_BUCKETS``). A request refused
without its grammar's compile failing is counted by ``REFUSAL_REASONS``; a request refused
because its compile failed is the compile's result (one compile serves every request for its
spec). Label values are these fixed sets only (no tenant, no spec): the node's metrics carry
the ``node`` label alone.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

COMPILE_RESULTS = (
    "compiled",  # loaded and cached
    "spec_error",  # the spec does not compile (INVALID_ARGUMENT, remembered per tenant)
    "timeout",  # past grammar_compile_timeout_s of compiler CPU time (INVALID_ARGUMENT, remembered)
    "out_of_memory",  # past grammar_worker_memory_bytes (INVALID_ARGUMENT, remembered)
    "compiler_died",  # its compiler process ended mid-compile: a crash, the memory cap (INVALID_ARGUMENT,
    # remembered), or killed by SIGKILL/SIGTERM (the node's: UNAVAILABLE, not remembered)
    "busy_refused",  # the node's load starved its compiler (RESOURCE_EXHAUSTED, not remembered)
    "failed",  # the node's failure: no compiler could start, its reply did not load (UNAVAILABLE)
    "shutdown",  # the node shut down while it ran (UNAVAILABLE)
    "dropped",  # queued, and no request waited on it any more: never ran
)
REFUSAL_REASONS = (
    "queue_full",  # the tenant had grammar_compile_queue_per_tenant compiles pending (RESOURCE_EXHAUSTED)
    "active_full",  # the tenant had grammar_max_active_per_tenant structured requests (RESOURCE_EXHAUSTED)
    "failed_spec",  # its spec failed for its tenant within FAILED_SPEC_TTL_S: refused without compiling
    "step_budget",  # its matcher passed grammar_step_budget_ms in one step
    "request_budget",  # its matcher passed grammar_request_budget_ms over its steps
    "no_token",  # its grammar (with allowed_token_ids) left no token to draw
)
SANDBOX_STATES = (
    "full",  # every mechanism of cache_node.sandbox applied ("confined: ...")
    "partial",  # some did ("partial: ...")
    "none",  # none could ("unconfined: ...", or no report)
)
"""How a ready compiler process is confined (``CompilerProcess.sandbox_state``), the label of
the gauge of compiler processes by sandbox (``Grammars.stats``' ``compiler_sandbox``)."""
COMPILE_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
"""Upper bounds of the compile-time histogram, s: a cached-schema compile takes milliseconds,
a costly spec up to the CPU limit (``grammar_compile_timeout_s``, 10 s by default) and the
wall limit a few times that."""


class GrammarCounters:
    """Compile results, refusals, cache look-ups and compile times. Thread-safe (compile
    threads, the step thread and ``add_request``'s callers count; a scrape reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.results = dict.fromkeys(COMPILE_RESULTS, 0)
        self.refusals = dict.fromkeys(REFUSAL_REASONS, 0)
        self.cache_queries = 0
        self.cache_hits = 0
        self._buckets = [0] * len(COMPILE_SECONDS_BUCKETS)  # per bound, not cumulative
        self._seconds_sum = 0.0
        self._seconds_count = 0

    def ended(self, result: str, seconds: float | None = None) -> None:
        """A compile ended with ``result`` (``COMPILE_RESULTS``), after ``seconds`` on its
        compiler process (None: it never ran on one)."""
        with self._lock:
            self.results[result] += 1
            if seconds is not None:
                i = bisect.bisect_left(COMPILE_SECONDS_BUCKETS, seconds)
                if i < len(self._buckets):
                    self._buckets[i] += 1
                self._seconds_sum += seconds
                self._seconds_count += 1

    def refused(self, reason: str) -> None:
        """A request was refused for ``reason`` (``REFUSAL_REASONS``)."""
        with self._lock:
            self.refusals[reason] += 1

    def looked_up(self, hit: bool) -> None:
        """A request's spec was looked up in the compiled-grammar cache."""
        with self._lock:
            self.cache_queries += 1
            self.cache_hits += hit

    def snapshot(self) -> dict[str, Any]:
        """Everything counted: ``compiles`` (result -> n), ``refusals`` (reason -> n),
        ``cache_queries``, ``cache_hits``, ``compile_seconds`` (cumulative ``[(le, n)]`` with
        ``+Inf`` last, ``sum``)."""
        with self._lock:
            cumulative, n = [], 0
            for bound, count in zip(COMPILE_SECONDS_BUCKETS, self._buckets):
                n += count
                cumulative.append((repr(bound), n))
            cumulative.append(("+Inf", self._seconds_count))
            return {"compiles": dict(self.results), "refusals": dict(self.refusals),
                    "cache_queries": self.cache_queries, "cache_hits": self.cache_hits,
                    "compile_seconds": {"buckets": cumulative, "sum": self._seconds_sum}}
