"""Compiled grammars are shared as prefix KV is: only inside a request's cache namespace (review
30b F1).

Regression: the grammar cache and the in-flight compiles were keyed by (kind, spec) alone, so a
tenant timed which JSON schemas, choice lists and regexes another tenant had sent (a 60-property
schema another tenant had used answered in ~140 ms, one nobody had in ~1 s), and went on timing
a deleted tenant's, whose grammars stayed after its ``end_tenant``. Every assertion here reads
the cache's own counts (``Grammars.stats``: compiles, look-ups, hits, entries), never a time.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from cache_node.grammar_cache import FailedSpecs, GrammarCache
from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import StructuredOutputSpec
from tests.conftest import make_grammars

SECRET = StructuredOutputSpec("regex", "(acme|globex|initech)-[0-9]{4}")
JSON_OBJECT = StructuredOutputSpec("json_object", "")
SLOW = StructuredOutputSpec("json_schema", json.dumps({"type": "string", "pattern": "(x|y){1,3000}"}))  # 1-3 s


class _Grammar:
    memory_size_bytes = 100


def _counts(s: dict[str, Any]) -> tuple[int, int, int]:
    """(compiles that compiled, cache look-ups, cache hits) of ``Grammars.stats()`` or
    ``LLMEngine.grammar_stats()`` (what ``grammar_compiles_total{result="compiled"}``,
    ``grammar_cache_queries_total`` and ``grammar_cache_hits_total`` export)."""
    return s["compiles"]["compiled"], s["cache_queries"], s["cache_hits"]


def _stats(g: Any) -> tuple[int, int, int]:
    return _counts(g.stats())


def _namespaces(g: Any) -> set[str]:
    return {key[0] for key in g._cache._kept}


def test_forget_drops_a_namespace_its_salted_variants_and_the_tenants_claims() -> None:
    """The cache alone: ``forget("a", "tenant:a")`` drops the entries of "tenant:a" and
    "tenant:a#salt=s" whoever claims them, gives up a's claim on the shared entry (which b's
    claim keeps) and drops one only a claimed, leaving b's and the bounds' counts exact;
    ``FailedSpecs.forget`` drops a's failures and any of its namespace, never b's."""
    cache = GrammarCache(max_entries=16, max_bytes=1 << 20)
    own, salted = ("tenant:a", "regex", "x"), ("tenant:a#salt=s", "regex", "x")
    shared, only_a = ("", "json_object", ""), ("team", "regex", "y")
    theirs = ("tenant:b", "regex", "x")
    for key, tenants in ((own, ["a"]), (salted, ["a"]), (shared, ["a", "b"]), (only_a, ["a"]), (theirs, ["b"])):
        assert cache.put(key, _Grammar(), tenants)
    assert cache.forget("a", "tenant:a") == 3  # own, salted, only_a (no other claim)
    assert set(cache._kept) == {shared, theirs} and cache.held("a") == (0, 0)
    assert cache.held("b")[0] == 2
    cache.check_integrity()
    assert cache.forget("a", "tenant:a") == 0  # idempotent

    failed = FailedSpecs(max_per_tenant=8, max_total=16, ttl_s=60.0)
    failed.put(own, ["a"], "m", now=0.0)
    failed.put(("team", "regex", "z"), ["a", "b"], "m", now=0.0)
    failed.put(theirs, ["b"], "m", now=0.0)
    failed.forget("a", "tenant:a")
    assert failed.held("a") == 0 and failed.num_entries == 2
    assert failed.failed(theirs, "b", now=1.0) == "m" and failed.failed(("team", "regex", "z"), "b", now=1.0) == "m"


@pytest.fixture(scope="module")
def tokenizer(grammar_tokenizer: Any) -> Any:
    return grammar_tokenizer


def test_a_spec_is_shared_inside_a_namespace_only(tokenizer: Any) -> None:
    """Tenant a compiles SECRET in its own namespace; tenant b's request for it (b's own
    namespace) is a cache miss and compiles it again, as is a's request with a cache salt; a's
    second request is a hit, and tenants c and d naming one shared namespace share its grammar.
    json_object, which carries nothing of a tenant's, is compiled once for every namespace. Two
    namespaces asking for one spec at once get two compiles (no request joins another
    namespace's compile in flight)."""
    g = make_grammars(tokenizer, workers=1)
    try:
        a = g.compile(SECRET, "a", "tenant:a").result(timeout=180)
        assert _stats(g) == (1, 1, 0)
        assert g.compile(SECRET, "b", "tenant:b").result(timeout=60) is not a  # a miss: compiled for b
        assert _stats(g) == (2, 2, 0)
        assert g.compile(SECRET, "a", "tenant:a").result(timeout=1) is a  # a's own: a hit
        assert _stats(g) == (2, 3, 1)
        assert g.compile(SECRET, "a", "tenant:a#salt=s").result(timeout=60) is not a  # salted: its own
        assert _stats(g) == (3, 4, 1)
        team = g.compile(SECRET, "c", "team").result(timeout=60)
        assert g.compile(SECRET, "d", "team").result(timeout=1) is team  # one shared namespace: shared
        assert _stats(g) == (4, 6, 2)
        obj = g.compile(JSON_OBJECT, "a", "tenant:a").result(timeout=60)
        assert g.compile(JSON_OBJECT, "b", "tenant:b").result(timeout=1) is obj
        assert _stats(g) == (5, 8, 3)

        other = StructuredOutputSpec("regex", "(umbrella|hooli)-[0-9]{3}")
        first, second = g.compile(other, "a", "tenant:a"), g.compile(other, "b", "tenant:b")
        assert first is not second
        assert first.result(timeout=60) is not second.result(timeout=60) and _stats(g)[0] == 7
        g._cache.check_integrity()
    finally:
        g.close()


def test_forget_leaves_nothing_of_the_tenants_namespace_and_keeps_a_running_compile_out(tokenizer: Any) -> None:
    """After ``forget("a", "tenant:a")`` the cache holds none of a's namespace's grammars (its
    salted one too), b's copy of the same spec stays a hit, a's claim on json_object is given up
    (b's keeps it), a's failed spec is forgotten, and a compile of a's namespace that was running
    ends with nothing kept."""
    g = make_grammars(tokenizer, workers=1)
    try:
        g.compile(SECRET, "a", "tenant:a").result(timeout=180)
        g.compile(SECRET, "a", "tenant:a#salt=s").result(timeout=60)
        b = g.compile(SECRET, "b", "tenant:b").result(timeout=60)
        g.compile(JSON_OBJECT, "a", "tenant:a").result(timeout=60)
        g.compile(JSON_OBJECT, "b", "tenant:b").result(timeout=1)
        assert g.compile(StructuredOutputSpec("regex", "("), "a", "tenant:a").exception(timeout=60) is not None
        assert g.stats()["failed_specs"] == 1 and len(g._cache) == 4
        slow = g.compile(SLOW, "a", "tenant:a")
        while not g._queue.counts()[1]:  # running
            time.sleep(0.01)
        assert g.forget("a", "tenant:a") == 2
        assert _namespaces(g) == {"tenant:b", ""} and g._cache.held("a") == (0, 0)
        assert g.stats()["failed_specs"] == 0 and not g._compiling
        assert slow.cancelled()
        deadline = time.monotonic() + 120
        while g._queue.counts()[1] and time.monotonic() < deadline:  # it runs to its end
            time.sleep(0.05)
        time.sleep(0.2)
        assert _namespaces(g) == {"tenant:b", ""}  # nothing of it kept
        assert g.compile(SECRET, "b", "tenant:b").result(timeout=1) is b
        g._cache.check_integrity()
    finally:
        g.close()


PROMPT = (1, 504, 3575, 28, 614, 1242, 314, 216, 1241, 2406, 30, 2)


def _request(rid: str, tenant: str, spec: StructuredOutputSpec) -> Any:
    from services.node_request import NodeRequest

    return NodeRequest(request_id=f"{tenant}/{rid}", tenant=tenant, cache_namespace=f"tenant:{tenant}",
                       token_ids=PROMPT, sampling=SamplingParams(max_tokens=2, structured_output=spec))


@pytest.mark.slow
def test_a_node_compiles_another_tenants_spec_again_and_end_tenant_drops_its_grammars(tokenizer: Any) -> None:
    """A ``CacheNode`` (the tiny Llama, SmolLM2's tokenizer): alice's regex request compiles it;
    bob's request for the same regex is a miss and compiles it (``grammar_cache_hits`` unchanged,
    compiled +1); alice's second is a hit. ``end_tenant("alice")`` leaves no grammar of
    "tenant:alice" in the cache; bob's stays a hit."""
    from bench.chaos_stack import tiny_checkpoint
    from services.cache_node import CacheNode
    from services.config import NodeConfig

    node = CacheNode("n0", NodeConfig(model_path=str(tiny_checkpoint()), kv_pool_bytes=4 << 20, host_bytes=0,
                                      grammar_compile_workers=1), num_threads=1)

    def serve(rid: str, tenant: str) -> tuple[int, int, int]:
        async def run() -> dict[str, Any]:
            return [event async for event in node.generate(_request(rid, tenant, SECRET))][-1]

        last = asyncio.run(run())
        assert last["type"] == "finished", last
        return _counts(node.engine.grammar_stats())

    try:
        assert serve("r1", "alice") == (1, 1, 0)
        assert serve("r1", "bob") == (2, 2, 0)  # a miss: compiled for bob
        assert serve("r2", "alice") == (2, 3, 1)
        assert serve("r2", "bob") == (2, 4, 2)
        assert _namespaces(node.engine.grammars) == {"tenant:alice", "tenant:bob"}
        node.end_tenant("alice")
        deadline = time.monotonic() + 30
        while "tenant:alice" in _namespaces(node.engine.grammars) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _namespaces(node.engine.grammars) == {"tenant:bob"}
        assert node.engine.grammar_stats()["cache_entries"] == 1
        assert serve("r3", "bob") == (2, 5, 3)
    finally:
        node.shutdown()
