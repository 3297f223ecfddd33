"""Tenants share a node's grammar compiler processes: one tenant's specs that blow a compile's
memory cap or CPU-time limit fail alone, each with its precise refusal (INVALID_ARGUMENT naming
the setting), while another tenant's spec queued behind them on the same, only, compiler
process compiles to a grammar that accepts its language (s39 open item 3; real compiler
processes, one for the node: ``workers=1``).

A compile runs alone on its process (``grammar_compile.serve``: one job at a time per process,
the fair queue handing tenants turns), and a compile that passes a limit kills its process,
the next compile starting a fresh one: so no other tenant's compile is on the process a
pathological spec ends. Measured (this host): a compiler process's data segment after
compiling ``[a-z]{N}`` for N up to 20,000 grew 8 MiB over its ready size (82 -> 91 MiB): no
compile leaves a process near its cap for the next tenant's.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from cache_node.structured_output import StructuredOutputSpec
from tests.conftest import make_grammars
from tests.test_grammar_compile_limits import SMALL_SCHEMA, _slow

MEMORY_BOMB = StructuredOutputSpec("json_schema", json.dumps({"enum": [f"v{i}" * 20 for i in range(700)]}))
"""57 KB (within the spec size bound) that needs more than 24 MiB to compile."""


@pytest.fixture(scope="module")
def tokenizer(grammar_tokenizer: Any) -> Any:
    return grammar_tokenizer


def _accepts(g: Any, compiled: Any, tokenizer: Any, text: str) -> bool:
    matcher = g.matcher(compiled)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_one_tenants_memory_and_cpu_bombs_fail_alone_on_a_shared_compiler(tokenizer: Any) -> None:
    g = make_grammars(tokenizer, workers=1, timeout_s=1.0, worker_memory_bytes=24 << 20, queue_per_tenant=2)
    try:
        g.compile(StructuredOutputSpec("regex", "[ab]"), "warm").result(timeout=120)
        first_pid = g.processes[0].pid
        t0 = time.monotonic()
        bombs = [g.compile(MEMORY_BOMB, "evil"), g.compile(_slow(), "evil")]
        goods = [g.compile(StructuredOutputSpec("json_schema", json.dumps(SMALL_SCHEMA)), "good"),
                 g.compile(StructuredOutputSpec("regex", "[0-9]{3}-[a-f]{2}"), "good")]
        compiled = [f.result(timeout=60) for f in goods]
        good_s = time.monotonic() - t0
        assert _accepts(g, compiled[0], tokenizer, '{"n": 7}') and not _accepts(g, compiled[0], tokenizer, '{"n": 70}')
        assert g.matcher(compiled[1]).accept_string("123-be") and not g.matcher(compiled[1]).accept_string("12-be")
        memory, cpu = (f.exception(timeout=60) for f in bombs)
        # the cap is met either as a bad_alloc the compiler replies (the usual case), or as the
        # process's death when what ran out was a thread's allocation (glibc: "cannot allocate
        # memory for thread-local data: ABORT", exit status 127: seen once in the s40 candidate
        # CI under load); both refuse the spec alone, naming the cap, never as the node's fault
        cap = f"{24 << 20}"
        by_reply = ("structured_output json_schema: its grammar needs more memory to compile than the cache node "
                    f"allows ({cap} bytes, grammar_worker_memory_bytes)")
        by_death = ("structured_output json_schema: its grammar compiler failed on it (the grammar compiler process "
                    f"ended before replying (exit status 127)); a compile may use at most {cap} bytes of memory "
                    "(grammar_worker_memory_bytes)")
        assert isinstance(memory, ValueError) and str(memory) in (by_reply, by_death), memory
        assert isinstance(cpu, ValueError) and str(cpu).startswith(
            "structured_output json_schema: its grammar did not compile within the cache node's limit of 1 s "
            "(grammar_compile_timeout_s)"), cpu
        # the good tenant waited at most the evil one's running compile (one turn each: the
        # memory bomb, ~0.3 s, and a fresh process's start), never its CPU bomb's whole limit
        # in addition to a queue of evil's
        assert good_s < 30, good_s
        assert g.processes[0].pid not in (None, first_pid)  # (killed twice, started again)
        again = g.compile(StructuredOutputSpec("regex", "[ab]+"), "good").result(timeout=60)
        assert g.matcher(again).accept_string("abba")
    finally:
        g.close()
