"""Structured outputs in the engine (xgrammar) on the real SmolLM2-135M: JSON schema, regex,
choice, json_object; unconstrained rows unchanged; a grammar that does not compile refuses its
request alone; a request waiting for its grammar holds nothing and aborts cleanly."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import pytest

from cache_node.engine import LLMEngine
from cache_node.grammar_process import CompilerProcess
from cache_node.outputs import GrammarQueueFull, InvalidRequestError, RequestOutput, SessionBusy
from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import StructuredOutputSpec
from tests.conftest import make_engine

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _engine(lm: Any, **overrides: int) -> LLMEngine:
    eng = make_engine(lm, **{"kv_pool_bytes": 32 << 20, "max_num_batched_tokens": 256, **overrides})
    assert eng.enable_structured_output(lm.tokenizer)
    return eng


@pytest.fixture(scope="module")
def shared_engine(real_model) -> Any:
    """One engine (``_engine``'s defaults) for the tests that need no fresh one: each checks
    counters as differences (a count of compiles over specs no other test uses) and leaves the
    engine holding nothing (asserted), so the next starts on an idle engine whose compiler
    processes already run (each engine's own cost ~1-3 s: the tokenizer's info, two processes'
    start). A grammar another test compiled may be cached (choice ["yes"]): those tests check
    the masking, not the compile."""
    eng = _engine(real_model)
    yield eng
    eng.close_structured_output()


def _prompt(lm: Any, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def _run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, RequestOutput]:
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    final: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + 300  # a first grammar waits for its compiler process to start (~2-10 s)
    while len(final) < len(ids) and time.monotonic() < deadline:
        outs = eng.step()
        for out in outs:
            if out.finished:
                final[out.request_id] = out
        if not outs:
            time.sleep(0.002)  # waiting for a compile: leave the CPU to the compiler
    return {i: final[i] for i in ids}


def _text(lm: Any, out: RequestOutput) -> str:
    return lm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)


def _spec(kind: str, spec: object = "") -> StructuredOutputSpec:
    return StructuredOutputSpec(kind, spec if isinstance(spec, str) else json.dumps(spec))


def _check_schema(value: object) -> None:
    """``value`` against ``SCHEMA`` (no jsonschema dependency: the schema is small)."""
    assert isinstance(value, dict) and set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 150


def test_constrained_rows_match_their_grammars_and_greedy_rows_beside_them_are_unchanged(real_model,
                                                                                         shared_engine) -> None:
    """One batch: a JSON-schema row, a regex row, a choice row and two unconstrained greedy rows.
    The constrained outputs parse / match / are a choice and end "stop" (the grammar's end); the
    unconstrained rows' tokens equal those of the same requests run without the others."""
    lm = real_model
    eng = shared_engine
    compiled_before = eng.grammars.num_compiled
    person = _prompt(lm, "Give me a person as JSON with a name and an age.")
    date = _prompt(lm, "What is today's date?")
    color = _prompt(lm, "Is the sky blue or green?")
    free = [_prompt(lm, "Write a haiku about the sea."), _prompt(lm, "Name three fruits.")]
    free_params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 2
    alone = _run(eng, free, free_params)
    constrained = [
        SamplingParams(max_tokens=60, structured_output=_spec("json_schema", SCHEMA)),
        SamplingParams(max_tokens=20, structured_output=_spec("regex", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
        SamplingParams(max_tokens=10, structured_output=_spec("choice", ["blue", "green", "red"])),
    ]
    outs = list(_run(eng, [person, date, color, *free], constrained + free_params).values())
    _check_schema(json.loads(_text(lm, outs[0])))
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", _text(lm, outs[1]))
    assert _text(lm, outs[2]) in ("blue", "green", "red")
    assert [o.finish_reason for o in outs[:3]] == ["stop"] * 3
    assert [o.output_token_ids for o in outs[3:]] == [o.output_token_ids for o in alone.values()]
    assert eng.grammars is not None and eng.grammars.num_compiled - compiled_before == 3
    assert not eng.requests and eng.kv_manager.pool.num_free_blocks() == eng.kv_manager.pool.num_blocks
    eng.kv_manager.pool.check_integrity()


def test_sampled_json_object_rows_parse_as_objects(real_model, shared_engine) -> None:
    """json_object at temperature 1 (two seeds): the text is one JSON object. (A prompt asking
    for a one-key object: on CPU both seeds' objects end within 20 tokens, so the parse is
    checked; "Describe a cat as a JSON object." gave objects past 80 tokens, both "length".)"""
    lm = real_model
    eng = shared_engine
    prompt = _prompt(lm, 'Describe a cat as a JSON object with one key, "name".')
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, top_k=20,
                             structured_output=_spec("json_object")) for s in (1, 4)]
    for out in _run(eng, [prompt, prompt], params).values():
        if out.finish_reason == "stop":  # (40 tokens may cut a long object: "length")
            assert isinstance(json.loads(_text(lm, out)), dict)
        else:
            assert out.finish_reason == "length"
    assert not eng.requests and not eng.scheduler.has_work()


def test_a_grammar_that_does_not_compile_refuses_its_request_alone(real_model, shared_engine) -> None:
    """A regex with an unclosed parenthesis: that request finishes "rejected" with the
    compiler's message naming structured_output and no tokens; a request beside it completes."""
    lm = real_model
    eng = shared_engine
    prompt = _prompt(lm, "Hello")
    outs = list(_run(eng, [prompt, prompt], [
        SamplingParams(max_tokens=4, structured_output=_spec("regex", "(abc")),
        SamplingParams(max_tokens=4, ignore_eos=True),
    ]).values())
    assert outs[0].finish_reason == "rejected" and outs[0].output_token_ids == ()
    assert outs[0].error is not None and outs[0].error.startswith("structured_output regex does not compile: ")
    assert "parenthesis is not closed" in outs[0].error and ".cc:" not in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].output_token_ids) == 4
    assert not eng.requests and not eng.scheduler.has_work()


def _hold_compiles(monkeypatch: Any) -> tuple[threading.Event, threading.Event]:
    """Compiles wait on the compiler (for ``gate``) once running; ``running`` is set then."""
    gate, running = threading.Event(), threading.Event()
    compile_ = CompilerProcess.compile

    def held(self: CompilerProcess, method: str, text: str, timeout_s: float) -> tuple[bool, str]:
        running.set()
        gate.wait(60)
        return compile_(self, method, text, timeout_s)

    monkeypatch.setattr(CompilerProcess, "compile", held)
    return gate, running


def test_aborting_a_request_whose_grammar_compiles_frees_everything(real_model, monkeypatch) -> None:
    """The compilation is held on its compiler (running): the request waits unscheduled with no
    blocks; an abort finishes it "abort"; the engine then holds nothing, and the late
    compilation (it was running: not dropped) is cached for the next request."""
    lm = real_model
    eng = _engine(lm)
    gate, running = _hold_compiles(monkeypatch)
    free_before = eng.kv_manager.pool.num_free_blocks()
    rid = eng.add_request(_prompt(lm, "Hi"), SamplingParams(max_tokens=8, structured_output=_spec("regex", "[a-z]+")))
    assert running.wait(120)  # its compiler process started and took it
    for _ in range(3):
        assert eng.step() == []
    seq = eng.requests[rid]
    assert seq in eng.scheduler.waiting and seq.block_table == [] and seq.num_computed_tokens == 0
    assert eng.kv_manager.pool.num_free_blocks() == free_before
    assert eng.abort_request(rid)
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")]
    assert not eng.requests and not eng.scheduler.has_work() and not eng._compiling
    assert eng.kv_manager.pool.num_free_blocks() == free_before
    gate.set()
    assert eng.step() == []
    ns = eng.config.cache_namespace_default  # the request's (grammars are kept per namespace)
    compiled = eng.grammars.compile(_spec("regex", "[a-z]+"), "", ns).result(timeout=60)  # the late compilation
    assert eng.grammars.compile(_spec("regex", "[a-z]+"), "", ns).result() is compiled  # kept
    assert (eng.grammars.num_compiled, eng.grammars.num_dropped) == (1, 0)


def test_a_queued_compile_no_request_waits_on_is_dropped(real_model, monkeypatch) -> None:
    """grammar_compile_queue_per_tenant 2, tenant t: its first compile runs (held), its second
    (two requests, one spec) waits queued, so a third spec is refused (GrammarQueueFull).
    Aborting one of the two keeps the compile queued (the other waits on it); aborting the
    other drops it: t's slot is free at once, the compile never runs and only the compiles
    still wanted are compiled. A session turn refused SessionBusy after its compile was queued
    drops it too; the third spec is then taken.

    Regression: a queued compile whose requests were aborted still ran, counted against its
    tenant's bound until it ended (a tenant aborting slow specs kept its queue full)."""
    lm = real_model
    eng = _engine(lm, grammar_compile_queue_per_tenant=2)
    gate, running = _hold_compiles(monkeypatch)
    prompt = _prompt(lm, "Hi")

    def add(pattern: str, **kw: Any) -> str:
        return eng.add_request(prompt, SamplingParams(max_tokens=4, structured_output=_spec("regex", pattern)),
                               tenant="t", **kw)

    first = add("[a-c]+", session_id="s")
    assert running.wait(120)
    queued = [add("[d-f]+"), add("[d-f]+")]
    future = eng.requests[queued[0]].grammar.future
    assert eng.requests[queued[1]].grammar.future is future and eng.grammars._queue.pending("t") == 2
    with pytest.raises(GrammarQueueFull):
        add("[g-i]+")
    assert eng.abort_request(queued[0])
    assert eng.grammars._queue.pending("t") == 2 and not future.done()
    assert eng.abort_request(queued[1])
    assert eng.grammars._queue.pending("t") == 1 and future.cancelled()
    assert ("regex", "[d-f]+") not in eng.grammars._compiling and eng.grammars.num_dropped == 1
    with pytest.raises(SessionBusy):
        add("[j-l]+", session_id="s")  # its compile was queued, then the turn refused
    assert eng.grammars._queue.pending("t") == 1 and eng.grammars.num_dropped == 2
    third = add("[g-i]+")  # t's freed slot
    assert eng.grammars._queue.pending("t") == 2
    gate.set()
    final: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + 120
    while len(final) < 4 and time.monotonic() < deadline:
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    assert {r: final[r].finish_reason for r in queued} == {queued[0]: "abort", queued[1]: "abort"}
    assert final[first].finish_reason in ("stop", "length") and final[third].finish_reason in ("stop", "length")
    assert eng.grammars.num_compiled == 2 and not eng.grammars._compiling and eng.grammars._queue.pending("t") == 0


def test_a_node_without_the_grammar_library_refuses_structured_requests_naming_the_field(real_model) -> None:
    """No ``enable_structured_output`` (no tokenizer), or xgrammar missing: refused at once."""
    lm = real_model
    eng = make_engine(lm, kv_pool_bytes=32 << 20)
    with pytest.raises(InvalidRequestError, match="structured_output: this cache node cannot constrain output"):
        eng.add_request([1, 2, 3], SamplingParams(structured_output=_spec("json_object")))
    import sys
    saved = sys.modules.get("xgrammar")
    sys.modules["xgrammar"] = None  # type: ignore[assignment]  (import raises ImportError)
    try:
        assert not eng.enable_structured_output(lm.tokenizer)
    finally:
        sys.modules["xgrammar"] = saved  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match="xgrammar library is not installed"):
        eng.add_request([1, 2, 3], SamplingParams(structured_output=_spec("json_object")))
    assert not eng.requests and not eng.scheduler.has_work()


def test_a_complete_grammar_ends_its_request_short_of_min_tokens(real_model, shared_engine) -> None:
    """choice ["yes"] with min_tokens 10: after "yes" the grammar allows only EOS, which
    min_tokens holds back; the request ends "stop" with "yes" (no NaN, no garbage token)."""
    lm = real_model
    eng = shared_engine
    for temperature in (0.0, 1.0):
        out = next(iter(_run(eng, [_prompt(lm, "Say yes.")], [SamplingParams(
            max_tokens=20, min_tokens=10, temperature=temperature, seed=3,
            structured_output=_spec("choice", ["yes"]))]).values()))
        assert (_text(lm, out), out.finish_reason) == ("yes", "stop")
    assert not eng.requests and not eng.scheduler.has_work()


def test_preempted_constrained_request_keeps_its_grammar_state(real_model, shared_engine) -> None:
    """A pool so small that the JSON request is preempted and recomputed: its matcher is never
    fed a token twice (the output still parses against the schema) and it equals the run that
    was never preempted (on ``shared_engine``: its pool holds both requests)."""
    lm = real_model
    prompt = _prompt(lm, "Give me a person as JSON with a name and an age.")
    params = SamplingParams(max_tokens=40, structured_output=_spec("json_schema", SCHEMA))
    roomy = next(iter(_run(shared_engine, [prompt], [params]).values()))
    assert roomy.num_preemptions == 0 and not shared_engine.requests
    other_prompt = _prompt(lm, "Count from one to twenty.")
    blocks = -(-(max(len(prompt), len(other_prompt)) + 40) // 16)  # each fits alone, not both
    tight = _engine(lm, kv_pool_bytes=blocks * shared_engine.pool.bytes_per_block)
    try:
        other = SamplingParams(max_tokens=40, ignore_eos=True)
        tight.grammars.compile(params.structured_output, "", tight.config.cache_namespace_default).result(
            timeout=300)  # cached for the requests' namespace: both start at once
        other_out, out = _run(tight, [other_prompt, prompt], [other, params]).values()  # newest: preempted first
    finally:
        tight.close_structured_output()
    assert out.num_preemptions >= 1 and other_out.finish_reason == "length"
    assert out.output_token_ids == roomy.output_token_ids and out.finish_reason == "stop"
    _check_schema(json.loads(_text(lm, out)))


def test_allowed_token_ids_that_leave_the_grammar_nothing_never_draw_a_nan(real_model, shared_engine) -> None:
    """choice ["yes"] under allowed_token_ids: allowing "yes"'s tokens but not EOS, the request
    ends "stop" with "yes" once only EOS is left; allowing only a token the grammar never takes,
    it is refused ("rejected", INVALID_ARGUMENT, naming structured_output and allowed_token_ids)
    before any draw (greedy and sampled: no garbage token, no NaN draw; not a node failure)."""
    lm = real_model
    eng = shared_engine
    failed_before = eng.num_failed_requests
    yes = lm.tokenizer.encode("yes")
    other = lm.tokenizer.encode(" maybe")[0]
    prompt = _prompt(lm, "Say yes.")
    for temperature in (0.0, 1.0):
        done, stuck = _run(eng, [prompt, prompt], [
            SamplingParams(max_tokens=8, temperature=temperature, seed=1, allowed_token_ids=yes,
                           structured_output=_spec("choice", ["yes"])),
            SamplingParams(max_tokens=8, temperature=temperature, seed=1, allowed_token_ids=[other],
                           structured_output=_spec("choice", ["yes"])),
        ]).values()
        assert (_text(lm, done), done.finish_reason) == ("yes", "stop")
        assert (stuck.output_token_ids, stuck.finish_reason) == ((), "rejected")
        assert stuck.error == ("structured_output: the grammar allows none of the tokens allowed_token_ids leaves "
                               "after 0 output tokens")
    assert not eng.requests and not eng.scheduler.has_work() and eng.num_failed_requests == failed_before
