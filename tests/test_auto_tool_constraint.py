"""``tool_choice: "auto"`` (the hermes parser) with every tool ``strict`` constrains generation:
text is free until the model writes ``<tool_call>``; from there only a call of a declared tool,
with arguments matching its parameters' schema, can follow (``chat_tools.auto_constraint``,
xgrammar's structural tag, as SGLang constrains strict tools' auto calls). HTTP builds it
(``ToolFields.structured_output``), so whole and streamed replies, stateless and session turns
are held to it, and gRPC builds the same from ``Tool.strict``; tools that are not all strict
leave "auto" free text read afterwards, as vLLM's default (review 31: constraining
every "auto" forced a plain mention of ``<tool_call>`` into a call, failed schemas xgrammar
cannot compile, and took a grammar slot per tools request).

Regression: "auto" was constrained by nothing and its text parsed afterwards, so a model that
wrote ``<tool_call>{"name": "delete_files", ...}</tool_call>`` (a function the request did not
declare), or a declared one with arguments off its schema, got it back as a tool call with finish
reason ``tool_calls``. Reproduced here with the real SmolLM2-135M, greedy: a few-shot history
makes it call ``delete_files``, which the request's tools do not hold.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import StructuredOutputSpec
from services.gateway_inputs import input_from_pb
from services.openai_api.schemas import ChatCompletionRequest
from services.tool_calls import ToolOutput, parse_hermes
from tests.conftest import make_engine, make_grammars
from tests.test_grpc_tool_calls import AUTO, pb_tools, request
from tests.test_tool_calls_served import SCHEMAS, TOOLS

pytest.importorskip("xgrammar")

USER = {"role": "user", "content": "What is the weather in Paris?"}
STRICT = [tool | {"function": tool["function"] | {"strict": True}} for tool in TOOLS]


def _undeclared(path: str) -> str:
    return f'<tool_call>\n{{"name": "delete_files", "arguments": {{"path": "{path}"}}}}\n</tool_call>'


def _fewshot() -> list[dict[str, str]]:
    """A history whose every reply calls ``delete_files`` (not among ``TOOLS``): SmolLM2 copies it."""
    shots: list[dict[str, str]] = []
    for path in ("/tmp", "/home", "/var", "/etc"):
        shots += [{"role": "user", "content": f"Delete {path}"}, {"role": "assistant", "content": _undeclared(path)}]
    return [*shots, {"role": "user", "content": "Delete /srv"}]


def _http_spec(tools: list[dict[str, Any]] = STRICT, **fields: Any) -> StructuredOutputSpec | None:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], "tools": tools, **fields})
    return body.structured_output()


def _grpc_spec(tools: list[dict[str, Any]] = TOOLS, **fields: Any) -> StructuredOutputSpec | None:
    return input_from_pb(request([USER], tools=pb_tools(tools), **fields), tool_call_parser="hermes",
                         seed="s").sampling.structured_output


def test_auto_is_constrained_when_every_tool_is_strict() -> None:
    """Strict tools without ``tool_choice`` (auto) and with ``tool_choice`` "auto" give the same
    constraint (``parallel_tool_calls`` false: one call, then the end); a constraint the client
    gives itself is the only one (auto is not constrained beside it, as before)."""
    spec = _http_spec()
    assert spec is not None and spec.kind == "structural_tag"  # (structured_output.TOOL_CALLS_KIND)
    assert _http_spec(tool_choice="auto") == spec
    one = _http_spec(parallel_tool_calls=False)
    assert one is not None and one != spec
    assert json.loads(one.spec)["format"]["stop_after_first"] is True
    # gRPC's strict tools (``Tool.strict``) give the same constraint (regression: gRPC had no
    # field for it, so its "auto" was never constrained)
    assert _grpc_spec(STRICT) == spec and _grpc_spec(STRICT, tool_choice=AUTO) == spec
    assert _grpc_spec(STRICT, parallel_tool_calls=False) == one
    own = _http_spec(structured_outputs={"regex": "a+"})
    assert own is not None and own.kind == "regex"
    assert _http_spec(tool_choice="none") is None
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], "tools": STRICT})
    assert body.constraint_path() == "tool_choice"  # (a compile refusal names it: errors.refusal_about)


def test_auto_is_free_text_unless_every_tool_is_strict() -> None:
    """Review 31: constraining every "auto" request forced a plain reply that mentioned
    ``<tool_call>`` into a call with made-up arguments, failed tools whose schemas xgrammar
    cannot compile (``\\p{L}``) or compiles for over 10 s, and held one of the tenant's 16 grammar
    slots per tools request. Tools not all strict, over either API, give no
    constraint: the text is read afterwards, as vLLM's default, and needs no grammar."""
    assert _http_spec(TOOLS) is None and _http_spec(TOOLS, tool_choice="auto") is None
    assert _http_spec([STRICT[0], TOOLS[1]]) is None  # one not strict
    assert _grpc_spec() is None and _grpc_spec(tool_choice=AUTO) is None
    assert _grpc_spec([STRICT[0], TOOLS[1]]) is None
    pattern = {"type": "object", "properties": {"word": {"type": "string", "pattern": "^\\p{L}+$"}}}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": pattern}}]
    assert _http_spec(tools) is None  # served unconstrained: nothing to compile
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], "tools": TOOLS})
    assert body.constraint_path() is None
    text = "In the hermes format you write <tool_call> and then the call as JSON."
    assert ToolOutput("auto", names=SCHEMAS).message(text, "stop") == ({"content": text}, "stop")


@pytest.fixture(scope="module")
def grammars(grammar_tokenizer: Any) -> Any:
    made = make_grammars(grammar_tokenizer)
    yield made
    made.close()


def _admits(grammars: Any, tokenizer: Any, spec: StructuredOutputSpec, text: str) -> bool:
    """Whether ``spec``'s grammar (the node's compiler) takes ``text``'s tokens and may end after them."""
    matcher = grammars.matcher(grammars.compile(spec).result(timeout=120))
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and (matcher.is_terminated() or matcher.accept_token(tokenizer.eos_token_id))


def test_the_auto_constraint_admits_only_declared_calls(grammars: Any, grammar_tokenizer: Any) -> None:
    """Compiled by the node's compiler for SmolLM2's vocabulary: free text and calls of declared
    tools with schema-valid arguments pass; an undeclared name, arguments off the schema (a
    missing required property, an unknown one, a value outside an enum) and unclosed JSON do not."""
    spec, one = _http_spec(), _http_spec(parallel_tool_calls=False)
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}\n</tool_call>'
    flight = '<tool_call>\n{"name": "book_flight", "arguments": {"to": "CDG"}}\n</tool_call>'
    for text in ("It is sunny in Paris.", "Let me check. " + weather, weather + flight, weather + " Done."):
        assert _admits(grammars, grammar_tokenizer, spec, text), text  # type: ignore[arg-type]
    for text in (_undeclared("/"),
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                 ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true, "x": 1}}\n'
                  "</tool_call>"),
                 '<tool_call>\n{"name": "book_flight", "arguments": {"to": "JFK"}}\n</tool_call>',
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}\n</tool_call>'):
        assert not _admits(grammars, grammar_tokenizer, spec, text), text  # type: ignore[arg-type]
    assert _admits(grammars, grammar_tokenizer, one, weather)  # type: ignore[arg-type]
    assert not _admits(grammars, grammar_tokenizer, one, weather + flight)  # type: ignore[arg-type]


def _generate(eng: Any, tokenizer: Any, prompt: list[int], spec: StructuredOutputSpec | None,
              ) -> tuple[str, str | None]:
    rid = eng.add_request(prompt, SamplingParams(max_tokens=48, temperature=0.0, structured_output=spec))
    deadline = time.monotonic() + 300  # the first grammar waits for its compiler process to start
    while time.monotonic() < deadline:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                assert out.error is None, out.error
                return tokenizer.decode(out.output_token_ids, skip_special_tokens=True), out.finish_reason
        time.sleep(0.002)
    raise AssertionError("the request did not finish")


def _read(text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None, dict[str, Any], str | None]:
    """``text`` read as a whole response's message and as a stream (``ToolOutput.delta`` per
    character, then ``end``)."""
    whole, reason = ToolOutput("auto", names=SCHEMAS).message(text, finish_reason)
    stream = ToolOutput("auto", names=SCHEMAS)
    for ch in text:
        stream.delta(ch)
    last, streamed_reason = stream.end(finish_reason)
    return whole, reason, last, streamed_reason


@pytest.mark.slow
def test_a_model_calling_an_undeclared_function_is_held_to_the_declared_ones(real_model: Any) -> None:
    """SmolLM2, greedy, after a history of ``delete_files`` calls: unconstrained (the old
    "auto"), it writes a ``delete_files`` call, which reads as a tool call (the fault). With the
    request's auto constraint (as either API builds it) it still starts a call, and that call is
    of a declared tool with arguments its schema takes, whole and streamed; finish reason
    ``tool_calls``."""
    lm = real_model
    eng = make_engine(lm, kv_pool_bytes=32 << 20, max_num_batched_tokens=256)
    assert eng.enable_structured_output(lm.tokenizer)
    try:
        prompt = lm.tokenizer.apply_chat_template(_fewshot(), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
        free, reason = _generate(eng, lm.tokenizer, prompt, None)
        assert free.startswith(_undeclared("/srv")), free  # the situation is forced: the model calls delete_files
        assert [c["function"]["name"] for c in parse_hermes(free)] == ["delete_files"]  # "auto" returned it as a call

        spec = _http_spec()
        text, reason = _generate(eng, lm.tokenizer, prompt, spec)
        whole, whole_reason, last, streamed_reason = _read(text, reason)
        assert whole_reason == streamed_reason == "tool_calls", (text, reason)
        calls = [c["function"] for c in whole["tool_calls"]]
        assert calls and calls == [c["function"] for c in last["tool_calls"]]
        for call in calls:
            assert call["name"] in SCHEMAS, (text, calls)  # a declared tool
            SCHEMAS[call["name"]].model_validate_json(call["arguments"])  # declared, schema-valid arguments
    finally:
        eng.close_structured_output()
