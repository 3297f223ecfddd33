"""Grammar-constrained decoding (structured outputs) with xgrammar.

A request with ``SamplingParams.structured_output`` gets a ``GrammarState``
(``cache_node.grammar_mask``): its grammar is compiled by ``Grammars``, off the step loop and
out of the node's process; the request waits in the queue, holding no KV, until the
compilation ends (``GrammarState.ready``); one that fails is refused (the engine finishes it
"rejected" with the message: the compiler's, or the time limit's). The per-step masking is
``cache_node.grammar_mask.constrain``.

Compilation (a spec's cost is its sender's to choose: a JSON schema pattern ``(x|y){1,3000}``
takes 3-5 s, and a 64 KiB spec holds dozens of those; one compile and the compile threads are
``cache_node.grammar_compile``'s): ``CompileLimits.workers`` compiler
processes (``cache_node.grammar_process``, started on first use and kept, at niceness 19), each
compile at most ``timeout_s`` of its process's CPU time and ``WALL_LIMIT_FACTOR`` times it of wall
time (past either its process is killed, the request refused naming the limit, or the node's load,
and a fresh process started), each process's compiles capped at ``worker_memory_bytes``; a grammar a
process sends is loaded and made into a probe matcher on the compile thread (``_probe``: a
failure refuses it, the process replaced, nothing cached); waiting compiles
are queued per tenant and served round-robin, one running per tenant
(``cache_node.grammar_queue``), at most ``queue_per_tenant`` pending per tenant (past it
``GrammarQueueFull``); a queued compile that no request waits on any more (each ``release``d:
aborted, refused) is dropped, a running one finishes and is cached. One compile serves every
request for its spec in its cache namespace, and is queued under each tenant waiting on it (each tenant's request
holds a future of its own), so it runs at the earliest turn of any of them: no tenant waits on
another's queue. Compiled grammars are cached by (cache namespace, kind, spec)
(``grammar_key``), bounded by entries and bytes and fair per tenant (a tenant past its share
evicts its own least recently used first); a spec that failed is refused at once for
``FAILED_SPEC_TTL_S`` to the tenants that met the failure (``cache_node.grammar_cache``).

A compiled grammar, a compile in flight and a failed spec are shared as prefix KV is: only by
requests of the same cache namespace (salt included; tenants naming one shared
``cache_namespace`` share them, as they share prefix KV), so no tenant learns from a request's
latency whether another tenant sent a spec (its JSON schema's property names and enums, its
choices, its regex). ``json_object`` (one fixed grammar, nothing of a tenant's in it) is
compiled once per node for everyone. A deleted tenant's own namespace's grammars go with its KV
(``forget``). Regression (review 30b F1): keyed by (kind, spec), a 60-property schema another
tenant (even a deleted one) had used answered in ~140 ms, an unused one in ~1 s.

xgrammar is imported only when a node enables structured outputs (``Grammars.create``); a
node without it refuses structured requests with a message saying so.
Source: Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models" (MLSys 2025, arXiv:2411.15100): a pushdown automaton whose context-independent
tokens are precomputed per state, leaving few tokens to check at runtime.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from cache_node.grammar_cache import FailedSpecs, GrammarCache, Key, in_holder
from cache_node.grammar_compile import (
    JSON_OBJECT_SCHEMA,
    SHUTTING_DOWN,
    STOP_TIMEOUT_S,
    CompileLimits,
    GrammarUnavailable,
    choice_grammar,
    compile_request,
    resolved,
    run_compile,
    serve,
    settle,
    stop,
)
from cache_node.grammar_process import CompilerDied, CompilerProcess
from cache_node.grammar_queue import FairCompileQueue
from cache_node.grammar_stats import SANDBOX_STATES, GrammarCounters
from cache_node.outputs import GrammarQueueFull
from cache_node.structured_output import StructuredOutputSpec
from cache_node.tiers.fair_lru import holder_of

__all__ = ["FAILED_SPEC_TTL_S", "GRAMMAR_CACHE_ENTRIES", "JSON_OBJECT_SCHEMA", "STOP_TIMEOUT_S", "XGRAMMAR_VERSION",
           "CompileLimits", "Grammars", "choice_grammar", "compile_request", "grammar_key"]  # (some defined in grammar_compile)

GRAMMAR_CACHE_ENTRIES = 256
"""Most compiled grammars kept (by ``grammar_key``); their bytes are bounded by
``CompileLimits.cache_bytes`` too."""

FAILED_SPEC_TTL_S = 60.0
"""How long a spec whose compile failed (did not compile, ran past the time limit, killed its
compiler) is refused at once to the tenants whose requests waited on that compile, without
compiling it again."""

FAILED_SPECS_PER_TENANT = 32
"""Most failed specs remembered for one tenant (``GRAMMAR_CACHE_ENTRIES`` for all tenants)."""

XGRAMMAR_VERSION = "0.2.9"

log = logging.getLogger(__name__)

SHARED_KINDS = frozenset({"json_object"})
"""Kinds whose grammar is the same for every request (no spec): kept once for all namespaces."""


def grammar_key(spec: StructuredOutputSpec, namespace: str) -> Key:
    """What ``spec``'s compiled grammar, compile in flight and failure are kept under for a
    request of cache namespace ``namespace`` (``Sequence.cache_namespace``, salt included): its
    namespace, kind and spec; "" for the namespace of a ``SHARED_KINDS`` spec."""
    return ("" if spec.kind in SHARED_KINDS else namespace, spec.kind, spec.spec)


@dataclass(eq=False)
class _Job:
    """One compile of ``key``, waited on by requests of one or more tenants: each tenant's requests get
    that tenant's future (so ``release`` knows whose request stopped waiting); all are
    finished together."""

    key: Key
    spec: StructuredOutputSpec
    futures: dict[str, Future[Any]] = field(default_factory=dict)  # tenant -> its requests' future
    waiters: dict[str, int] = field(default_factory=dict)  # tenant -> requests given it, not released
    ended: bool = False  # ``Grammars._finish`` ran (counted)
    forgotten: bool = False  # its namespace's tenant was deleted (``Grammars.forget``): nothing is kept of it

    def add(self, tenant: str) -> Future[Any]:
        future = self.futures.get(tenant)
        if future is None:
            future = self.futures[tenant] = Future()
        self.waiters[tenant] = self.waiters.get(tenant, 0) + 1
        return future


class Grammars:
    """Compiles specs to xgrammar grammars in compiler processes, and keeps the compiled ones.

    Args:
        xgr: the ``xgrammar`` module.
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits width (``config.vocab_size``, padding included).
        stop_token_ids: the tokens that end a grammar's output (the engine's EOS ids).
        max_num_seqs: most rows a step samples (the host bitmask's rows).
        limits: time, memory, fairness and cache bounds of compiling.
        counters: where its compiles, refusals and cache look-ups are counted
            (``cache_node.grammar_stats``; the engine's, which outlive this object).
    """

    def __init__(self, xgr: Any, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int],
                 max_num_seqs: int, limits: CompileLimits | None = None,
                 counters: GrammarCounters | None = None) -> None:
        self.xgr = xgr
        self.counters = counters or GrammarCounters()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.limits = limits or CompileLimits()
        self._tokenizer = tokenizer
        self._info: Any = None  # TokenizerInfo, built by the first compile (0.5-0.8 s)
        self._info_json = ""  # its serialize_json(), sent to each process started
        self._lock = threading.Lock()
        self._info_lock = threading.Lock()
        self._cache = GrammarCache(GRAMMAR_CACHE_ENTRIES, self.limits.cache_bytes)
        self._failed = FailedSpecs(FAILED_SPECS_PER_TENANT, GRAMMAR_CACHE_ENTRIES, FAILED_SPEC_TTL_S)
        self._compiling: dict[Key, _Job] = {}  # queued or running
        self._queue: FairCompileQueue[_Job] = FairCompileQueue(self.limits.queue_per_tenant)
        self.processes: list[CompilerProcess | None] = [None] * self.limits.workers
        # the threads hold the queue and the processes, not ``self``: a ``Grammars`` no longer
        # referenced (its engine dropped) is collected, and its finalizer stops them
        self._threads = [threading.Thread(target=serve, args=(weakref.ref(self), self._queue, self.processes, i),
                                          name=f"grammar-compile-{i}", daemon=True)
                         for i in range(self.limits.workers)]
        for thread in self._threads:
            thread.start()
        # close(), garbage collection or interpreter exit: no compiler process is left behind
        self._finalizer = weakref.finalize(self, stop, self._lock, self._queue, self.processes, self._threads)
        self.bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)  # (rows, ceil(V / 32)) int32, host

    # (these read ``counters``: one count of each compile's end)
    @property
    def num_compiled(self) -> int:
        return self.counters.results["compiled"]

    @property
    def num_timeouts(self) -> int:
        """Compiles killed at the time limit (starved by the node's load or not)."""
        return self.counters.results["timeout"] + self.counters.results["busy_refused"]

    @property
    def num_compiler_deaths(self) -> int:
        """Compiler processes that ended mid-compile (memory cap, crash, killed from outside)."""
        return self.counters.results["compiler_died"]

    @property
    def num_dropped(self) -> int:
        """Queued compiles dropped: no request waited on them any more."""
        return self.counters.results["dropped"]

    def stats(self) -> dict[str, Any]:
        """``counters.snapshot()`` and what is held now: ``compiles_queued`` (compiles
        waiting for a compiler, each once however many tenants it is queued under),
        ``compiles_running``, ``compiler_processes`` (alive), ``compiler_sandbox`` (the ready
        ones by ``grammar_stats.SANDBOX_STATES``), ``cache_entries`` and ``cache_bytes`` (the
        compiled grammars kept), ``failed_specs`` (remembered)."""
        processes = [p for p in list(self.processes) if p is not None]
        alive = sum(1 for p in processes if p.pid is not None)
        sandbox = dict.fromkeys(SANDBOX_STATES, 0)
        for state in (p.sandbox_state for p in processes):
            if state is not None:
                sandbox[state] += 1
        with self._lock:
            queued, running = self._queue.counts()
            held = {"compiles_queued": queued, "compiles_running": running, "compiler_processes": alive,
                    "compiler_sandbox": sandbox,
                    "cache_entries": len(self._cache), "cache_bytes": self._cache.num_bytes,
                    "failed_specs": self._failed.num_entries}
        return self.counters.snapshot() | held

    @classmethod
    def create(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int],
               max_num_seqs: int, limits: CompileLimits | None = None,
               counters: GrammarCounters | None = None) -> Grammars | str:
        """``Grammars`` for this tokenizer, or why there cannot be (xgrammar missing)."""
        try:
            import xgrammar
        except ImportError as exc:
            return (f"this cache node cannot constrain output: the xgrammar library is not installed ({exc}); "
                    f"pip install xgrammar=={XGRAMMAR_VERSION}")
        return cls(xgrammar, tokenizer, vocab_size, stop_token_ids, max_num_seqs, limits, counters)

    def compile(self, spec: StructuredOutputSpec, tenant: str = "", namespace: str = "") -> Future[Any]:
        """The compiled grammar of ``spec`` for a request of ``tenant`` in cache namespace
        ``namespace`` (a future: one cached for that namespace, one compiling for it, or one
        queued for ``tenant``; ``grammar_key``). A failed compile's future holds a ValueError
        naming ``structured_output``; the same spec is then refused at once to each tenant that
        waited on it, for ``FAILED_SPEC_TTL_S``. A caller that stops waiting on it calls
        ``release``.

        Raises:
            GrammarQueueFull: ``tenant`` has ``queue_per_tenant`` compiles pending.
        """
        key = grammar_key(spec, namespace)
        with self._lock:
            compiled = self._cache.get(key, tenant)
            self.counters.looked_up(compiled is not None)
            if compiled is not None:
                return resolved(compiled)
            failed = self._failed.failed(key, tenant, time.monotonic())
            if failed is not None:
                self.counters.refused("failed_spec")
                return resolved(error=ValueError(
                    f"{failed} (this spec failed within the last {FAILED_SPEC_TTL_S:g} s: refused without compiling)"))
            if self._queue.closed:
                return resolved(error=GrammarUnavailable(SHUTTING_DOWN))
            job = self._compiling.get(key)
            if job is None:
                job = _Job(key, spec)
                if not self._queue.put(tenant, job):
                    raise self._full()
                self._compiling[key] = job
            elif tenant not in job.futures and self._queue.join(tenant, job) is False:
                # queued under other tenants: queued under this one too, so it runs at the
                # earliest turn of any of them (a running one is just waited on)
                raise self._full()
            return job.add(tenant)

    def _full(self) -> GrammarQueueFull:
        self.counters.refused("queue_full")
        return GrammarQueueFull(
            f"structured_output: this tenant already has {self.limits.queue_per_tenant} grammars compiling "
            f"or queued on this cache node (grammar_compile_queue_per_tenant); retry when they finish")

    def release(self, spec: StructuredOutputSpec, future: Future[Any], namespace: str = "") -> None:
        """A request given ``future`` by ``compile(spec, tenant, namespace)`` waits on it no more (it finished:
        aborted, or refused after ``compile``). When no request of its tenant waits on that
        compile and it is still queued, it leaves that tenant's queue (no longer counting
        against its ``queue_per_tenant``) and that tenant's future is cancelled; once it is
        queued for no tenant it is dropped (``num_dropped``): no compiler runs it. A running one
        goes on, and its grammar is cached. Call it once per ``compile`` that returned a
        pending future; one that returned a done future (cached, failed) is ignored.

        Regression: an aborted request's queued compile still ran, holding its tenant's slot."""
        with self._lock:
            job = self._compiling.get(grammar_key(spec, namespace))
            tenant = next((t for t, f in job.futures.items() if f is future), None) if job is not None else None
            if job is None or tenant is None:
                return
            job.waiters[tenant] -= 1
            if job.waiters[tenant] > 0 or not self._queue.remove(tenant, job):
                return
            del job.futures[tenant], job.waiters[tenant]
            if not job.futures:
                del self._compiling[job.key]
                self.counters.ended("dropped")
        future.cancel()

    def _run(self, slot: int, job: _Job) -> bool:
        """Compile ``job`` on process ``slot`` (started if need be) and finish its future.
        True when the process was killed (the caller starts another once the tenant's turn is
        given back: a restart's import is no compile of that tenant)."""
        try:
            process = self._process(slot)
            if process.pid is None:
                process.start()
        except CompilerDied as exc:
            if self._queue.closed:  # (``close`` stopped it)
                self._finish(job, error=SHUTTING_DOWN, result="shutdown")
                return False
            log.error("grammar compiler %d could not start: %s", slot, exc)
            self._finish(job, error=f"structured_output: this cache node's grammar compiler could not start ({exc})",
                         result="failed")
            return False
        start = time.monotonic()
        outcome = run_compile(process, job.spec, self.limits, lambda: self._queue.closed)
        if outcome.text is None:
            self._finish(job, failed=outcome.failed, error=outcome.error, busy=outcome.busy, result=outcome.result,
                         seconds=time.monotonic() - start)
            if outcome.kill:
                process.kill()
            return outcome.killed
        try:
            compiled = self.xgr.CompiledGrammar.deserialize_json(outcome.text, self._info)
            self._probe(compiled)
        except Exception as exc:  # noqa: BLE001 - the process's bytes are untrusted like any other
            log.error("grammar compiler %d sent a grammar that does not load: %s", slot, exc)
            self._finish(job, error="structured_output: the compiled grammar could not be loaded", result="failed",
                         seconds=time.monotonic() - start)
            process.kill()
            return True
        self._finish(job, compiled=compiled, result="compiled", seconds=time.monotonic() - start)
        return False

    def _process(self, slot: int) -> CompilerProcess:
        """Slot ``slot``'s compiler process handle (the tokenizer's info built on first use)."""
        with self._info_lock:  # not ``_lock``: ``compile`` (the step thread) never waits for this
            if self._info is None:
                self._info = self.xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                self._info_json = self._info.serialize_json()
        process = self.processes[slot]
        if process is None:
            process = self.processes[slot] = CompilerProcess(self._info_json, self.limits.worker_memory_bytes)
            if self._queue.closed:  # (``stop`` closed the queue before it read ``processes``: it may have
                process.close()  # missed this one, which then never starts)
        return process

    def _warm(self, slot: int) -> None:
        """Start ``slot``'s process ahead of its first compile (a failure is left to that compile).

        Any failure, not only ``CompilerDied``: an exception here (the tokenizer's vocabulary
        unreadable by xgrammar, ``Popen``'s EAGAIN/ENOMEM/EMFILE) used to end the compile thread,
        and every structured request after it waited for its grammar forever."""
        try:
            self._process(slot).start()
        except Exception as exc:  # noqa: BLE001 - logged; the compile meets it again and refuses its request
            if not self._queue.closed:
                log.error("grammar compiler %d could not start: %s: %s", slot, type(exc).__name__, exc)

    def _restart(self, slot: int) -> None:
        """Start ``slot``'s process again at once (it was killed), so that the next compile
        does not wait for the import; a failed start is left to the next compile."""
        process = self.processes[slot]
        if self._queue.closed or process is None or process.pid is not None:
            return
        try:
            process.start()
        except Exception as exc:  # noqa: BLE001 - as ``_warm``: the thread must go on
            if not self._queue.closed:  # (else ``close`` killed it)
                log.error("grammar compiler %d could not restart: %s: %s", slot, type(exc).__name__, exc)

    def _finish(self, job: _Job, compiled: Any = None, failed: str | None = None, error: str | None = None,
                busy: bool = False, result: str = "failed", seconds: float | None = None) -> None:
        """End ``job``: its grammar kept (``compiled``), or its spec remembered as failed
        (``failed``: the spec's fault, INVALID_ARGUMENT) or not (``error``: the node's, a
        ``GrammarUnavailable``; ``busy``: its load starved the compile). Counted as ``result``
        (``grammar_stats.COMPILE_RESULTS``) after ``seconds`` on a compiler process (None: it
        ran on none)."""
        with self._lock:
            if not job.ended:  # (a failure after its end, in ``serve``, is not counted again)
                job.ended = True
                self.counters.ended(result, seconds)
            if self._compiling.get(job.key) is job:
                del self._compiling[job.key]
            futures = list(job.futures.items())  # no tenant joins it any more
            if job.forgotten:
                pass  # its namespace's tenant is gone: its requests get it, nothing keeps it
            elif compiled is not None:
                self._cache.put(job.key, compiled, [tenant for tenant, _ in futures])
            elif failed is not None:
                self._failed.put(job.key, [tenant for tenant, _ in futures], failed, time.monotonic())
        exc = None if compiled is not None else (
            ValueError(failed) if failed is not None else GrammarUnavailable(error or "structured_output: not compiled", busy))
        settle([f for _, f in futures], compiled, exc)

    def forget(self, tenant: str, namespace: str) -> int:
        """``tenant`` (a deleted tenant's id) is gone and ``namespace`` was its own: drop the
        grammars kept for that namespace (salted variants too) and ``tenant``'s claims on the
        others (``GrammarCache.forget``), its failed specs, its place in the compile queue (its
        futures cancelled; a queued compile no other tenant waits on is dropped); a compile of
        that namespace still running ends with nothing kept. Returns the cache entries dropped.
        Regression (review 30b F1): a deleted tenant's grammars stayed, and told which specs it
        had used to any tenant timing a request."""
        holder = holder_of(namespace)
        cancelled: list[Future[Any]] = []
        with self._lock:
            dropped = self._cache.forget(tenant, holder)
            self._failed.forget(tenant, holder)
            for job in list(self._compiling.values()):
                future = job.futures.pop(tenant, None)
                if future is not None:
                    del job.waiters[tenant]
                    cancelled.append(future)
                    if self._queue.remove(tenant, job) and not job.futures:  # queued for no one now
                        del self._compiling[job.key]
                        job.ended = True
                        self.counters.ended("dropped")
                        continue
                if in_holder(job.key, holder):  # (a running one: ``_finish`` keeps nothing of it)
                    job.forgotten = True
                    del self._compiling[job.key]
        for future in cancelled:
            future.cancel()
        return dropped

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)

    def _probe(self, compiled: Any) -> None:
        """Build a matcher of ``compiled`` and fill one row of a scratch bitmask with it, on the
        compile thread: a grammar a compiler process sent that loads (``deserialize_json``)
        but cannot make a matcher or a mask raises here, before it is cached or reaches a
        request's ``GrammarState.poll`` on the step thread.

        Regression (review 28a F1): a loadable grammar whose ``GrammarMatcher`` raised (the
        child's reply with its ``optimized`` flag cleared) ended the node's step loop, every
        tenant's streams with it."""
        scratch = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher(compiled).fill_next_token_bitmask(scratch, 0)

    def close(self) -> None:
        """Stop compiling: queued compiles fail, running ones' processes are killed, and every
        compiler process is reaped (within ``STOP_TIMEOUT_S``). Idempotent; also run when this
        object is collected and at interpreter exit."""
        self._finalizer()
