"""Structured outputs served end to end, without Ray: the real CacheNode (xgrammar on the node),
scheduler, gateway gRPC server and OpenAI app of ``test_logprobs_served`` (a tiny random Llama
with SmolLM2's tokenizer). A JSON-schema request's text parses and validates against its
schema, a regex's matches, a choice's is one of them, over gRPC (``SamplingParams.
structured_output``) and both HTTP endpoints (OpenAI's ``response_format``, vLLM's
``structured_outputs`` and ``guided_*``), whole, streamed and for every choice of ``n``; bad
input is INVALID_ARGUMENT / a 400 naming its field.

The random model's most probable allowed token inside a JSON value is whitespace, which JSON
allows between any two tokens (xgrammar's ``any_whitespace``, vLLM's default too), so its JSON
would run to ``max_tokens``; the JSON tests ban the vocabulary's 166 whitespace-only tokens
with ``logit_bias`` -100 (applied after the grammar's mask: the grammar never needs them).

Before these fields were served, ``response_format`` ``json_object`` / ``json_schema`` was a 400
("only {"type": "text"} is supported"), the other fields 400s "unsupported field", and every
request crossing the data plane was refused "request.sampling: unknown fields
['structured_output']"."""

from __future__ import annotations

import dataclasses
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Literal

import grpc
import pytest
from pydantic import BaseModel, ConfigDict

from kvstrata.v1 import inference_pb2 as pb
from tests.test_logprobs_served import PROMPT, Served


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool


SCHEMA = Weather.model_json_schema()
REGEX = r"[0-9]{3}-[a-z]{2}"
CHAT = {"messages": [{"role": "user", "content": "The weather, as JSON."}], "max_tokens": 40}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


@pytest.fixture(scope="module")
def no_whitespace(served: Served) -> dict[int, float]:
    """``logit_bias`` banning every whitespace-only token (see the module docstring)."""
    tok = served.tokenizer
    bias = {i: -100.0 for i in range(len(tok)) if (text := tok.decode([i])) and not text.strip()}
    assert 0 < len(bias) <= 4096
    return bias


def _text_and_end(responses: list[pb.GenerateResponse]) -> tuple[str, str]:
    text = "".join(r.delta.text for r in responses if r.WhichOneof("event") == "delta")
    return text, responses[-1].finished.finish_reason


def test_grpc_json_schema_regex_and_choice_outputs_match(served: Served, no_whitespace: dict[int, float]) -> None:
    """Greedy and sampled: the JSON parses into ``Weather``, the regex matches whole, the choice
    is one of the list, each ending "stop" (the grammar's end) well before ``max_tokens``."""
    for temperature in (0.0, 1.0):
        text, end = _text_and_end(served.generate(
            max_tokens=40, temperature=temperature, seed=7, logit_bias=no_whitespace,
            structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA))))
        assert end == "stop", text
        Weather.model_validate_json(text)
        text, end = _text_and_end(served.generate(max_tokens=40, temperature=temperature, seed=7,
                                                  structured_output=pb.StructuredOutput(regex=REGEX)))
        assert end == "stop" and re.fullmatch(REGEX, text), text
        choices = ["blue", "green", "red"]
        text, end = _text_and_end(served.generate(
            max_tokens=40, temperature=temperature, seed=7,
            structured_output=pb.StructuredOutput(choice=pb.ChoiceList(choices=choices))))
        assert end == "stop" and text in choices, text


def test_grpc_unconstrained_requests_are_unchanged(served: Served) -> None:
    """The same greedy request without a constraint gives the same tokens as before a
    constrained one ran beside it (the mask touches only constrained rows)."""
    before = _text_and_end(served.generate(max_tokens=6, ignore_eos=True))
    served.generate(max_tokens=6, structured_output=pb.StructuredOutput(regex=REGEX))
    assert _text_and_end(served.generate(max_tokens=6, ignore_eos=True)) == before


@pytest.mark.parametrize(("constraint", "details"), [
    (pb.StructuredOutput(), ("sampling.structured_output must set one of json_object, json_schema, regex, choice, "
                            "grammar")),
    (pb.StructuredOutput(json_object=False), "sampling.structured_output.json_object must be true"),
    (pb.StructuredOutput(json_schema="[]"), "sampling.structured_output json_schema must be a JSON object"),
    (pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", "a"])), ("sampling.structured_output choice lists a "
                                                                     "string twice")),
    (pb.StructuredOutput(choice=pb.ChoiceList(choices=[str(i) for i in range(257)])),
     "sampling.structured_output.choice.choices holds more than 256 elements"),
    (pb.StructuredOutput(regex="(abc"), "sampling.structured_output regex does not compile"),  # the node's compiler
    (pb.StructuredOutput(grammar="root ::= nothing"), "sampling.structured_output grammar does not compile"),
    # a grammar with a dead end (after "a" nothing may follow): refused at that step, no token drawn
    (pb.StructuredOutput(grammar='root ::= "a" b\nb ::= b "c"'),
     "sampling.structured_output: the grammar allows no token after 1 output tokens (it cannot complete)"),
])
def test_grpc_bad_constraints_are_invalid_argument_naming_the_field(served: Served, constraint: pb.StructuredOutput,
                                                                    details: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        served.generate(max_tokens=4, structured_output=constraint)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(details), err.value.details()


def test_a_tenant_past_its_compile_queue_is_resource_exhausted_and_429(served: Served) -> None:
    """A structured request whose tenant has ``grammar_compile_queue_per_tenant`` compiles pending
    on its node (``GrammarQueueFull``; the bound set to 0 here, on the node's live queue) is
    RESOURCE_EXHAUSTED over gRPC with the node's message and a ``retry-after-ms`` trailer of
    1000, and a 429 ``rate_limit_error`` over HTTP with ``Retry-After: 1`` that the client may
    retry (no ``x-should-retry: false``); the same request is served once there is room.

    Regression: the node answered it INVALID_ARGUMENT (HTTP 400), as a malformed request that a
    retry cannot fix; then (session 28) its 429 had no ``Retry-After``."""
    queue = served.node.engine.grammars._queue
    bound = queue.max_per_tenant
    full = f"this tenant already has {bound} grammars compiling or queued on this cache node (grammar_compile_queue"
    queue.max_per_tenant = 0
    try:
        with pytest.raises(grpc.RpcError) as err:  # a spec compiled nowhere yet: it must be queued
            served.generate(max_tokens=4, structured_output=pb.StructuredOutput(regex="[0-9]{4}x"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details().startswith(f"structured_output: {full}"), err.value.details()
        assert ("retry-after-ms", "1000") in err.value.trailing_metadata()
        _http_429(served, "[0-9]{4}y", full)
    finally:
        queue.max_per_tenant = bound
    text, end = _text_and_end(served.generate(max_tokens=8, structured_output=pb.StructuredOutput(regex="[0-9]{4}x")))
    assert end == "stop" and re.fullmatch("[0-9]{4}x", text), text


def _http_429(served: Served, regex: str, message: str) -> None:
    """A completion constrained to ``regex`` is a retryable 429 naming ``message``, with
    ``Retry-After: 1`` (and ``retry-after-ms``)."""
    req = urllib.request.Request(
        f"{served.base}/completions",
        json.dumps({"model": served.model, "prompt": PROMPT, "max_tokens": 4, "guided_regex": regex}).encode(),
        {"Authorization": f"Bearer {served.key}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(req, timeout=60)
    body = json.loads(http.value.read())
    assert http.value.code == 429 and body["error"]["type"] == "rate_limit_error", body
    assert message in body["error"]["message"] and "x-should-retry" not in http.value.headers, body
    assert (http.value.headers["Retry-After"], http.value.headers["retry-after-ms"]) == ("1", "1000")


def test_a_tenant_past_its_active_structured_requests_is_resource_exhausted_and_429(served: Served) -> None:
    """grammar_max_active_per_tenant set to 1 on the node's live engine: while the tenant's
    structured request streams, its next is RESOURCE_EXHAUSTED over gRPC naming the setting,
    with ``retry-after-ms`` 1000, and a 429 with ``Retry-After: 1`` over HTTP; once the first is
    cancelled (aborted on the node) the count is back to none and the next is served.

    Regression: no such bound (one tenant's grammars could take every row of a step), and no
    ``Retry-After`` on the node's 429s."""
    engine = served.node.engine
    config = engine.config
    full = "this tenant already has 1 structured-output requests on this cache node (grammar_max_active_per_tenant)"
    engine.config = dataclasses.replace(config, grammar_max_active_per_tenant=1)
    try:
        request = pb.GenerateRequest(tokens=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(
            max_tokens=400, structured_output=pb.StructuredOutput(regex="[0-9]{400}")))
        first = served.stub.Generate(request, metadata=(("authorization", f"Bearer {served.key}"),), timeout=60)
        assert next(r for r in first if r.WhichOneof("event") == "delta").delta.text  # it decodes
        with pytest.raises(grpc.RpcError) as err:
            served.generate(max_tokens=4, structured_output=pb.StructuredOutput(regex="[0-9]{2}"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == f"structured_output: {full}; retry when one of them finishes"
        assert ("retry-after-ms", "1000") in err.value.trailing_metadata()
        _http_429(served, "[0-9]{3}", full)
        first.cancel()
        deadline = time.monotonic() + 30
        while engine._grammar_active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine._grammar_active == {}
    finally:
        engine.config = config
    text, end = _text_and_end(served.generate(max_tokens=8, structured_output=pb.StructuredOutput(regex="[0-9]{2}")))
    assert end == "stop" and re.fullmatch("[0-9]{2}", text), text


def _content(path: str, body: Any) -> list[str]:
    """Each choice's text of a whole response, or a stream's (its chunks joined per index)."""
    if isinstance(body, dict):
        return [c["message"]["content"] if path == "/chat/completions" else c["text"] for c in body["choices"]]
    texts: dict[int, str] = {}
    for chunk in body:
        for c in chunk.get("choices", []):
            piece = c["delta"].get("content") if path == "/chat/completions" else c.get("text")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return [texts[i] for i in sorted(texts)]


def _prompt(path: str) -> dict[str, Any]:
    return dict(CHAT) if path == "/chat/completions" else {"prompt": PROMPT, "max_tokens": 40}


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_http_response_format_json_schema_parses_and_validates(served: Served, no_whitespace: dict[int, float],
                                                               path: str, stream: bool) -> None:
    """OpenAI's ``response_format`` json_schema on both endpoints, whole and streamed, n 1 and
    n 3 (each choice sampled with its own seed): every text validates against the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    bias = {str(i): b for i, b in no_whitespace.items()}
    for n in (1, 3):
        body = {**_prompt(path), "response_format": fmt, "logit_bias": bias, "n": n, "temperature": 1.0, "seed": 11,
                "stream": stream}
        status, reply = served.post(path, body)
        assert status == 200, reply
        texts = _content(path, reply)
        assert len(texts) == n
        for text in texts:
            Weather.model_validate_json(text)


@pytest.mark.parametrize(("fields", "check"), [
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"grammar": 'root ::= "a" [0-9] [0-9]'}}, lambda t: re.fullmatch(r"a[0-9]{2}", t)),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_grammar": 'root ::= "b" [0-9]'}, lambda t: re.fullmatch(r"b[0-9]", t)),
])
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_http_vllms_structured_outputs_and_guided_extras_constrain(served: Served, path: str,
                                                                   fields: dict[str, Any], check: Any) -> None:
    status, reply = served.post(path, {**_prompt(path), **fields})
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "stop"
    text = _content(path, reply)[0]
    assert check(text), text


def test_http_schema_given_as_vllms_json_and_guided_json(served: Served, no_whitespace: dict[int, float]) -> None:
    bias = {str(i): b for i, b in no_whitespace.items()}
    for fields in ({"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": json.dumps(SCHEMA)}},
                   {"guided_json": SCHEMA}):
        status, reply = served.post("/chat/completions", {**CHAT, **fields, "logit_bias": bias})
        assert status == 200, reply
        Weather.model_validate_json(reply["choices"][0]["message"]["content"])


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"response_format": {"type": "yaml"}}, "response_format", 'type must be "text", "json_object" or "json_schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name", "String should match pattern '^[a-zA-Z0-9_-]{1,64}$'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w" * 65, "schema": SCHEMA}}},
     "response_format.json_schema.name", "String should match pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
     "response_format.json_schema.schema", "Field required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": [1]}}},
     "response_format.json_schema.schema", "Input should be a valid dictionary"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "Input should be a valid boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"a": json.loads("[" * 40 + "]" * 40)}}}},
     "response_format.json_schema.schema", "the schema nests more than 32 levels deep"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema", "unsupported field"),
    ({"structured_outputs": {"regex": REGEX, "choice": ["a"]}}, "structured_outputs",
     "must give exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"structured_outputs": {}}, "structured_outputs", "must give exactly one of"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "must be true"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "spec is not valid JSON"),
    ({"structured_outputs": {"choice": ["a"] * 257}}, "structured_outputs.choice", "lists 257 choices; at most 256"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "unsupported field"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "Input should be a valid string"),
    ({"guided_regex": ""}, "guided_regex", "needs a non-empty spec"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "strings must be non-empty"),
    ({"guided_choice": "a"}, "guided_choice", "Input should be a valid list"),
    ({"guided_json": [1]}, "guided_json", "Input should be a valid dictionary or a valid string"),
    ({"guided_grammar": "x" * 70_000}, "guided_grammar", "spec is 70000 bytes; at most 65536 are allowed"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "unsupported field"),
    ({"response_format": {"type": "json_object"}, "guided_regex": REGEX}, "response_format",
     "give one structured output constraint, not 2 (got response_format and guided_regex)"),
    ({"structured_outputs": {"regex": REGEX}, "guided_choice": ["a"], "guided_json": SCHEMA}, "structured_outputs",
     "give one structured output constraint, not 3 (got structured_outputs and guided_json and guided_choice)"),
    ({"guided_regex": "(abc"}, "guided_regex", "guided_regex: regex does not compile"),  # the node's compiler
    # trial 29k P3: named by the path README gives, not the top-level field
    ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs.regex", "structured_outputs.regex: regex does not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema: json_schema does not compile"),
    ({"guided_grammar": 'root ::= "a" b\nb ::= b "c"'}, "guided_grammar",  # a dead end, at its step
     "the grammar allows no token after 1 output tokens (it cannot complete)"),
])
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_http_bad_constraints_are_400_naming_the_field(served: Served, path: str, fields: dict[str, Any], param: str,
                                                       message: str) -> None:
    status, body = served.post(path, {**_prompt(path), **fields})
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert body["error"]["message"].startswith(param) and message in body["error"]["message"], body


def test_http_text_and_json_object_formats_are_taken(served: Served, no_whitespace: dict[int, float]) -> None:
    """``{"type": "text"}`` is no constraint (the same greedy text as none); ``json_object``'s
    content is one JSON object on both endpoints, though ``logit_bias`` makes "[" the model's
    first choice (greedy: the sampled random model writes a key that runs to ``max_tokens``).

    Regression: json_object compiled xgrammar's built-in JSON grammar, whose root is an object
    or an array (this request got ``[[[[...`` to ``max_tokens``); this test checked only the status."""
    status, plain = served.post("/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
    assert status == 200, plain
    status, text = served.post("/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                "response_format": {"type": "text"}})
    assert status == 200 and text["choices"][0]["text"] == plain["choices"][0]["text"], text
    (bracket,) = served.tokenizer.encode("[", add_special_tokens=False)
    bias = {**{str(i): b for i, b in no_whitespace.items()}, str(bracket): 100.0}
    for path in ("/chat/completions", "/completions"):
        status, reply = served.post(path, {**_prompt(path), "max_tokens": 40, "temperature": 0, "logit_bias": bias,
                                           "response_format": {"type": "json_object"}})
        assert status == 200, reply
        text = _content(path, reply)[0]
        assert reply["choices"][0]["finish_reason"] == "stop" and isinstance(json.loads(text), dict), text


def test_the_official_openai_client_sends_response_format(served: Served, no_whitespace: dict[int, float]) -> None:
    """The unmodified ``openai`` package: ``response_format`` json_schema as a dict, and its own
    ``chat.completions.parse`` with the pydantic model (it builds the strict json_schema
    format and parses the reply into ``Weather``); vLLM's extras in ``extra_body``."""
    import openai

    client = openai.OpenAI(base_url=served.base, api_key=served.key, max_retries=0)
    bias = {str(i): b for i, b in no_whitespace.items()}
    messages = CHAT["messages"]
    chat = client.chat.completions.create(
        model=served.model, messages=messages, max_tokens=40, logit_bias=bias,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
    Weather.model_validate_json(chat.choices[0].message.content or "")
    parsed = client.chat.completions.parse(model=served.model, messages=messages, max_tokens=40,  # type: ignore[arg-type]
                                           logit_bias=bias, response_format=Weather)
    assert isinstance(parsed.choices[0].message.parsed, Weather)
    guided = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert guided.choices[0].text in ("up", "down")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served.model, messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                       response_format={"type": "json_schema", "json_schema": {"name": "bad name",
                                                                                               "schema": SCHEMA}})
    assert err.value.body["param"] == "response_format.json_schema.name"  # type: ignore[index]
