"""Structured outputs' per-tenant bounds on a cache node (session 28): the memory of specs that
failed to compile is per tenant, bounded per tenant and in all (``FailedSpecs``).

Regression: one list of failed specs for all tenants (256, oldest out first): a spec that
failed for one tenant was refused to every tenant for 60 s, and one tenant's 256 cheap failing
regexes flushed every other tenant's entries, letting a slow spec compile to its limit again.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from cache_node.grammar_cache import FailedSpecs
from cache_node.structured_output import StructuredOutputSpec
from tests.conftest import make_grammars

REFUSED = "refused without compiling"


def test_failed_specs_are_remembered_per_tenant_within_their_bounds() -> None:
    """A failure put for tenants a and b is refused to them until its TTL passes, never to c;
    a's 5th failure pushes out a's oldest (per-tenant bound 4); past the total bound (6) the
    tenant holding the most gives up its oldest, so b's entry stays while a floods."""
    failed = FailedSpecs(max_per_tenant=4, max_total=6, ttl_s=10.0)
    failed.put(("regex", "bad"), ["a", "b"], "structured_output regex does not compile: x", now=100.0)
    assert failed.failed(("regex", "bad"), "a", now=109.9) == "structured_output regex does not compile: x"
    assert failed.failed(("regex", "bad"), "c", now=100.0) is None
    assert failed.failed(("regex", "bad"), "b", now=110.0) is None and failed.held("b") == 0  # expired
    for i in range(5):
        failed.put(("regex", f"a{i}"), ["a"], "m", now=101.0 + i)
    assert failed.held("a") == 4 and failed.failed(("regex", "bad"), "a", now=106.0) is None  # its oldest out
    failed.put(("regex", "b0"), ["b"], "m", now=107.0)
    failed.put(("regex", "c0"), ["c"], "m", now=107.0)
    assert failed.num_entries == 6
    failed.put(("regex", "a9"), ["a"], "m", now=108.0)  # 7 in all: a (the most) gives up a1
    assert failed.num_entries == 6 and failed.held("a") == 4 and failed.failed(("regex", "a1"), "a", 108.0) is None
    assert failed.failed(("regex", "b0"), "b", 108.0) == "m" and failed.failed(("regex", "c0"), "c", 108.0) == "m"
    failed.put(("regex", "a9"), ["a"], "again", now=109.0)  # refreshed, not counted twice
    assert failed.num_entries == 6 and failed.failed(("regex", "a9"), "a", 109.0) == "again"
    off = FailedSpecs(max_per_tenant=4, max_total=6, ttl_s=0.0)
    off.put(("regex", "bad"), ["a"], "m", now=1.0)
    assert off.failed(("regex", "bad"), "a", now=1.0) is None and off.num_entries == 0


@pytest.fixture(scope="module")
def tokenizer(grammar_tokenizer: Any) -> Any:
    return grammar_tokenizer


def _grammars(tokenizer: Any, **limits: Any) -> Any:
    return make_grammars(tokenizer, **limits)


def _error(future: Any) -> str:
    return str(future.exception(timeout=60))


def test_a_failed_spec_is_refused_at_once_to_its_tenant_only_and_no_tenant_flushes_anothers(tokenizer) -> None:
    """Tenant a's regex "(abc" fails to compile; a sending it again is refused at once (not
    compiled: the compile count stays), tenant b's identical spec is compiled and fails with the
    compiler's message in its own right. Then a sends 40 distinct failing regexes (past its 32):
    b's memory of "(abc" stays, a's own oldest are pushed out.

    Regression: b's "(abc" was refused "without compiling" on a's failure, and a's flood
    (256 in all) emptied the one shared list."""
    g = _grammars(tokenizer, workers=1, queue_per_tenant=64)
    try:
        bad = StructuredOutputSpec("regex", "(abc")
        first = _error(g.compile(bad, "a"))
        assert first.startswith("structured_output regex does not compile") and REFUSED not in first
        t0 = time.monotonic()
        again = _error(g.compile(bad, "a"))
        assert REFUSED in again and time.monotonic() - t0 < 0.1
        b_first = _error(g.compile(bad, "b"))
        assert b_first.startswith("structured_output regex does not compile") and REFUSED not in b_first
        assert REFUSED in _error(g.compile(bad, "b"))
        flood = [g.compile(StructuredOutputSpec("regex", f"(a{i}"), "a") for i in range(40)]
        assert all("does not compile" in _error(f) for f in flood)
        assert g._failed.held("a") == 32 and g._failed.held("b") == 1
        assert REFUSED in _error(g.compile(bad, "b"))
        assert REFUSED not in _error(g.compile(bad, "a"))  # a's own flood pushed it out: compiled again
    finally:
        g.close()


# ---- grammar_max_active_per_tenant, through the engine (the real SmolLM2-135M) ---------------

@pytest.mark.slow
def test_a_tenant_past_its_active_structured_requests_is_refused_holding_nothing(real_model) -> None:
    """grammar_max_active_per_tenant 2: tenant a's third structured request, while its first two
    are queued or decoding, is refused ``GrammarActiveFull`` (a ``GrammarQueueFull``: the node
    answers RESOURCE_EXHAUSTED) naming the setting, holding nothing (no request, no compile
    queued, no block); tenant b's structured request and a's unconstrained one are taken. Once
    one of a's ends (aborted) its next is taken; when all have ended no count, block or
    compile is left. A request refused after its grammar was counted (a busy session) and one
    whose grammar fails to compile count no more either.

    Regression: no such bound: one tenant's constrained requests could fill every row of a step."""
    from cache_node.outputs import GrammarActiveFull, GrammarQueueFull, SessionBusy
    from cache_node.sampling_params import SamplingParams
    from tests.conftest import make_engine

    lm = real_model
    eng = make_engine(lm, kv_pool_bytes=32 << 20, max_num_batched_tokens=256, grammar_max_active_per_tenant=2)
    assert eng.enable_structured_output(lm.tokenizer)
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Pick a digit."}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False)

    def params(regex: str = "[0-9]{3}", n: int = 6) -> SamplingParams:
        return SamplingParams(max_tokens=n, structured_output=StructuredOutputSpec("regex", regex))

    try:
        a1 = eng.add_request(prompt, params(), tenant="a")
        eng.step()
        a2 = eng.add_request(prompt, params("[a-f]{3}"), tenant="a")
        free, pending = eng.kv_manager.pool.num_free_blocks(), eng.grammars._queue.pending("a")
        with pytest.raises(GrammarActiveFull, match=r"structured_output: this tenant already has 2 structured-output "
                                                    r"requests on this cache node \(grammar_max_active_per_tenant\)"):
            eng.add_request(prompt, params("[x-z]{3}"), request_id="a3", tenant="a")
        assert issubclass(GrammarActiveFull, GrammarQueueFull)
        assert "a3" not in eng.requests and eng.grammars._queue.pending("a") == pending
        assert eng.kv_manager.pool.num_free_blocks() == free and eng._grammar_active == {"a": 2}
        b1 = eng.add_request(prompt, params(), tenant="b")
        free_a = eng.add_request(prompt, SamplingParams(max_tokens=2), tenant="a")
        assert eng._grammar_active == {"a": 2, "b": 1}
        assert eng.abort_request(a2)
        a3 = eng.add_request(prompt, params("[x-z]{3}"), tenant="a")  # a2's place
        eng.add_request(prompt, SamplingParams(max_tokens=4), request_id="s1", session_id="s", tenant="c")
        with pytest.raises(SessionBusy):  # after its grammar was counted: uncounted
            eng.add_request(prompt, params(), request_id="s2", session_id="s", tenant="c")
        assert "c" not in eng._grammar_active
        eng.abort_request(a3)
        bad = eng.add_request(prompt, params("(abc"), tenant="a")  # fails to compile: rejected
        final: dict[str, Any] = {}
        deadline = time.monotonic() + 300
        while eng.requests and time.monotonic() < deadline:
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = out
            time.sleep(0.001)
        assert final[bad].finish_reason == "rejected" and final[a1].finish_reason in ("stop", "length")
        assert final[b1].finish_reason in ("stop", "length") and free_a in final
        assert eng._grammar_active == {} and not eng.requests
        eng.close_session("s")
        assert eng.kv_manager.pool.num_free_blocks() == eng.kv_manager.pool.num_blocks
    finally:
        eng.close_structured_output()


# ---- the retry hint of a node's grammar refusals, on the data plane -------------------------

def test_an_error_event_s_retry_hint_is_checked() -> None:
    """A node's error event may carry ``retry_after_s`` (a ``GrammarQueueFull``'s, 1 s), which the
    gateway turns into ``retry-after-ms``; it is bytes from the network: a value outside
    [0, 86400] (NaN and inf included), or on an event other than an error, fails that event."""
    import math

    from cache_node.outputs import GrammarActiveFull, GrammarQueueFull
    from services.data_plane import check_event

    error = {"type": "error", "code": "RESOURCE_EXHAUSTED", "message": "m"}
    assert check_event({**error, "retry_after_s": 1.0})["retry_after_s"] == 1.0
    assert GrammarQueueFull.retry_after_s == GrammarActiveFull.retry_after_s == 1.0
    for bad in (-1, 86401, math.nan, math.inf):
        with pytest.raises(ValueError, match="event.retry_after_s"):
            check_event({**error, "retry_after_s": bad})
    with pytest.raises(TypeError):
        check_event({**error, "retry_after_s": "1"})
    with pytest.raises(ValueError, match="error event only"):
        check_event({"type": "delta", "token_ids": [1], "text": "a", "retry_after_s": 1.0})
