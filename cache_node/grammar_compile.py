"""One grammar compile on one compiler process, and the threads that run them
(``cache_node.grammars``' back end).

What a compiler process is asked for a spec (``compile_request``), what one compile may cost
(``CompileLimits``) and how each way it can end is worded (``run_compile``: the grammar's text,
or a refusal naming the limit it passed, or the node's own failure), and the compile threads:
one per compiler process, each taking the fair queue's next job (``cache_node.grammar_queue``)
and running it (``serve``), all stopped and their processes reaped by ``stop``. The threads
hold the queue and the processes, not the ``Grammars`` that owns them (a weak reference): a
``Grammars`` no longer referenced is collected, and its finalizer (``stop``) ends them.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cache_node.grammar_process import CompilerDied, CompilerProcess, CompileTimeout
from cache_node.grammar_queue import FairCompileQueue
from cache_node.structured_output import TOOL_CALLS_KIND, StructuredOutputSpec

if TYPE_CHECKING:
    from cache_node.grammars import Grammars, _Job

log = logging.getLogger(__name__)

SHUTTING_DOWN = "structured_output: the cache node is shutting down"

BUSY_RETRY_S = 1.0
"""The retry hint of a compile the node's load starved (as a full compile queue's)."""


class GrammarUnavailable(ValueError):
    """A compile that failed for the node's reasons, not the spec's (its load starved the
    compiler, the node is shutting down, the compiler failed): the request is refused
    ``code`` (RESOURCE_EXHAUSTED with a ``retry_after_s`` hint when the node is too busy,
    else UNAVAILABLE), never INVALID_ARGUMENT, since the same spec may compile on a retry.

    Regression (review 28b F2 follow-up): such refusals were INVALID_ARGUMENT, which clients
    and the HTTP edge (400) take as "do not retry this body"."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.code = "RESOURCE_EXHAUSTED" if busy else "UNAVAILABLE"
        self.retry_after_s = BUSY_RETRY_S if busy else 0.0

STOP_TIMEOUT_S = 5.0
"""Longest ``Grammars.close`` waits for its compile threads to reap their processes."""


@dataclass(frozen=True)
class CompileLimits:
    """What compiling grammars may cost the node (``EngineConfig``'s ``grammar_*`` fields).

    Attributes:
        timeout_s: CPU-time limit of one compile (the compiler process's CPU seconds; it is
            killed past it), and ``grammar_process.WALL_LIMIT_FACTOR`` times it of wall time.
        workers: compiler processes (each ~76 MiB resident: xgrammar's compiler alone,
            ``grammar_worker.import_compiler``).
        queue_per_tenant: most compiles one tenant may have queued or running.
        cache_bytes: most bytes of compiled grammars kept (``grammar_cache.grammar_bytes``).
        worker_memory_bytes: what one process's compiles may allocate past its import
            (``RLIMIT_DATA`` headroom; 0: no cap).
    """

    timeout_s: float = 10.0
    workers: int = 2
    queue_per_tenant: int = 8
    cache_bytes: int = 256 << 20
    worker_memory_bytes: int = 2 << 30


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar (xgrammar's GBNF dialect) whose language is exactly ``choices``:
    ``root ::= "a" | "b"``, each string a quoted literal with JSON's escapes, which the dialect
    reads the same way (backslash, quote, control characters, \\uXXXX)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""What ``json_object`` compiles: any JSON object, as in vLLM (xgrammar's built-in JSON grammar,
``compile_builtin_json_grammar``, also admits an array at the top level)."""


def compile_request(spec: StructuredOutputSpec) -> tuple[str, str]:
    """What a compiler process is asked for ``spec``: ``(method, text)`` (``grammar_worker.METHODS``)."""
    if spec.kind == "json_object":
        return "json_schema", JSON_OBJECT_SCHEMA
    if spec.kind == "choice":
        return "grammar", choice_grammar(spec.choices)
    methods = {"json_schema": "json_schema", "regex": "regex", TOOL_CALLS_KIND: "structural_tag"}
    return methods.get(spec.kind, "grammar"), spec.spec


@dataclass(frozen=True)
class Outcome:
    """How one compile ended: ``text`` (the grammar's ``serialize_json``), else ``failed`` (the
    spec's fault: remembered and refused for a while) or ``error`` (the node's: not
    remembered). ``killed``: the process was killed, or is to be (``kill``: alive, killed once
    the job is finished), and a fresh one started; ``timeout`` / ``died``: it passed the time
    limit / ended mid-compile (the counters)."""

    text: str | None = None
    failed: str | None = None
    error: str | None = None
    killed: bool = False
    kill: bool = False
    timeout: bool = False
    busy: bool = False  # (``error``) the node's load starved the compile: retryable soon
    died: bool = False

    @property
    def result(self) -> str:
        """How it is counted (``grammar_stats.COMPILE_RESULTS``)."""
        if self.text is not None:
            return "compiled"
        if self.busy:
            return "busy_refused"
        if self.timeout:
            return "timeout"
        if self.died:
            return "compiler_died"
        if self.kill:
            return "out_of_memory"
        if self.failed is not None:
            return "spec_error"
        return "shutdown" if self.error == SHUTTING_DOWN else "failed"


KILLED_FROM_OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM})
"""The signals whose death of a compiler process mid-compile is the node's fault, not the spec's
(``run_compile``): SIGTERM is never the child's own doing; SIGKILL comes from an operator, the
node's shutdown, ``PR_SET_PDEATHSIG`` (``grammar_worker._die_with_parent``) or the kernel's OOM
killer under the node's (or its container's) memory pressure. A spec cannot bring the OOM killer
on its own: a compile's memory is capped by ``RLIMIT_DATA`` (``grammar_worker._cap_memory``), so
past ``grammar_worker_memory_bytes`` its allocation fails (``bad_alloc``, or the child aborts:
SIGABRT / SIGSEGV, which stay the spec's fault) well before the node runs out; and the child has
no CPU rlimit (its time limit is the node's kill, ``CompileTimeout``). A spec wrongly let off
this way costs one bounded compile per retry (its time and memory limits still hold)."""


def run_compile(process: CompilerProcess, spec: StructuredOutputSpec, limits: CompileLimits,
                closed: Callable[[], bool]) -> Outcome:
    """Compile ``spec`` on ``process`` (started already) within ``limits``; ``closed`` tells
    whether the node is shutting down (a process that died then was killed by ``stop``).

    A process that ended mid-compile is the spec's failure (remembered, INVALID_ARGUMENT),
    unless a signal of ``KILLED_FROM_OUTSIDE`` ended it: then the node's (UNAVAILABLE, not
    remembered). Regression (review 29a F4): a child killed by ``kill -9`` refused the valid
    request INVALID_ARGUMENT and its tenant's retries for ``FAILED_SPEC_TTL_S``."""
    kind = spec.kind
    try:
        ok, text = process.compile(*compile_request(spec), limits.timeout_s)
    except CompileTimeout as exc:
        if exc.starved:  # the node's load, not the spec's cost: not remembered against the spec
            used = f"{exc.cpu_s:.1f} s" if exc.cpu_s is not None else "too little"
            return Outcome(error=(
                f"structured_output {kind}: its grammar compiler had {used} of CPU time in {exc.wall_s:.0f} s "
                f"(its limit {limits.timeout_s:g} s, grammar_compile_timeout_s): this cache node is too busy to "
                f"compile it now; retry later"), killed=True, timeout=True, busy=True)
        return Outcome(failed=(
            f"structured_output {kind}: its grammar did not compile within the cache node's limit of "
            f"{limits.timeout_s:g} s (grammar_compile_timeout_s) of compiler CPU time; simplify it (fewer or "
            "smaller repetition counts, patterns and alternatives)"), killed=True, timeout=True)
    except CompilerDied as exc:
        if closed():
            return Outcome(error=SHUTTING_DOWN)
        if exc.signal in KILLED_FROM_OUTSIDE:  # the node's fault: retryable, not remembered
            return Outcome(error=(
                f"structured_output {kind}: this cache node's grammar compiler was killed while compiling it "
                f"({exc}); retry"), killed=True, died=True)
        return Outcome(failed=(
            f"structured_output {kind}: its grammar compiler failed on it ({exc}); a compile may use at most "
            f"{limits.worker_memory_bytes} bytes of memory (grammar_worker_memory_bytes)"), killed=True, died=True)
    if not ok and "bad_alloc" in text:  # the memory cap; the process is replaced to be safe
        return Outcome(failed=(
            f"structured_output {kind}: its grammar needs more memory to compile than the cache node allows "
            f"({limits.worker_memory_bytes} bytes, grammar_worker_memory_bytes)"), killed=True, kill=True)
    if not ok:
        return Outcome(failed=f"structured_output {kind} does not compile: {text[:300]}")
    return Outcome(text=text)


def serve(ref: weakref.ref[Grammars], queue: FairCompileQueue[_Job], processes: list[CompilerProcess | None],
          slot: int) -> None:
    """Compile thread ``slot``: start its process when the first compile is queued (every
    slot then, so that no request after the first waits for an import), run the queue's jobs
    on it until the queue closes, then reap it."""
    if queue.wait_used():
        grammars = ref()
        if grammars is not None:
            grammars._warm(slot)
        del grammars
    while (taken := queue.take()) is not None:
        tenant, job = taken
        grammars = ref()
        killed = False
        try:
            if grammars is None:
                settle(list(job.futures.values()), error=GrammarUnavailable(SHUTTING_DOWN))
            else:
                killed = grammars._run(slot, job)
        except Exception as exc:  # a bug here must not stop the thread nor strand the request
            log.exception("grammar compile thread %d", slot)
            if grammars is not None:
                grammars._finish(job, error=f"structured_output: the grammar compiler failed ({type(exc).__name__})")
        finally:
            queue.done(tenant)
        if killed and grammars is not None:
            grammars._restart(slot)
        # Hold nothing while waiting for the next job: the last job's futures keep their done
        # callbacks (the engine's bound methods), so a frame holding it kept the engine, and
        # through it this ``Grammars``, alive: its finalizer never ran and its processes stayed.
        del grammars, taken, job
    process = processes[slot]
    if process is not None:
        process.kill()


def stop(lock: threading.Lock, queue: FairCompileQueue[_Job], processes: list[CompilerProcess | None],
         threads: list[threading.Thread]) -> None:
    """``Grammars.close``: fail the queued compiles, kill the running ones and those being
    started, reap every process (each compile thread its own, joined within ``STOP_TIMEOUT_S``)."""
    with lock:  # ``compile`` adds a tenant's future to a job under it, and joins none once closed
        futures = [f for job in queue.close() for f in job.futures.values()]
    settle(futures, error=GrammarUnavailable(SHUTTING_DOWN))
    for process in processes:  # (one ``Grammars._process`` makes after this closes itself)
        if process is not None:
            process.close()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def settle(futures: list[Future[Any]], result: Any = None, error: BaseException | None = None) -> None:
    """Finish each of ``futures`` (one cancelled or finished meanwhile is skipped)."""
    for future in futures:
        if not future.done() and future.set_running_or_notify_cancel():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)


def resolved(result: Any = None, error: BaseException | None = None) -> Future[Any]:
    """A future finished already (a cached grammar, a refusal)."""
    fut: Future[Any] = Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
    return fut
