"""OpenAI's ``n`` > 1 (``services.openai_api.choices``) on the real call path without Ray: a
real CacheNode (the tiny Llama, ``SLOTS`` running slots), the GlobalScheduler's admission
server, the gateway's ``InferenceServicer`` and the OpenAI app served by uvicorn, all on one
event loop thread (``tests.loop_plane``); clients are plain HTTP connections and raw sockets.

Before: ``n`` was accepted at 1 only (any other value a 400 naming it)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from bench.chaos_stack import BLOCK_SIZE
from cache_node.sampling_params import SamplingParams
from services.auth import Authenticator
from services.gateway import GenerateInput, InferenceServicer
from services.gateway_stream_bounds import StreamLimits
from services.node_request import NodeRequest
from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.choices import ChoiceInputs, choice_seed, shared_routing_key
from services.openai_api.schemas import MAX_N, CompletionRequest
from services.openai_api.server import HttpServer
from tenants.model import TenantSpec
from tests.grpc_context import GrpcContext, Refused
from tests.known_tenants import know_tenants
from tests.loop_plane import Actor, LoopPlane, call, wait_for

SLOTS = 3
PROMPT = list(range(300, 340))  # 40 tokens: 2 full blocks (32 tokens) can be reused
REUSED = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE


class Edge(LoopPlane):
    """One node (``SLOTS`` running slots), the scheduler, a gateway servicer and its HTTP API."""

    def __init__(self) -> None:
        super().__init__(SLOTS, "kvstrata-choices-")
        self.servicer, self.http, self.port = self.gateway()
        tenant, self.key = self.run(call(self.scheduler.register_tenant, TenantSpec(name="choices")))
        self.tenant_id = tenant.tenant_id
        know_tenants(self.scheduler, "other")  # the blockers' tenant (sent past the gateway)
        self.model = self.node.describe()["model_id"].split("@", 1)[0]

    def gateway(self, limits: StreamLimits | None = None) -> tuple[InferenceServicer, HttpServer, int]:
        """A gateway's servicer (``limits``: its stream bounds) and its HTTP API on a free port."""
        info, handle = self.node.describe(), Actor(self.scheduler)
        servicer = InferenceServicer(handle, Authenticator(handle), {"n0": None}, {"n0": info}, None,
                                     self.sched_address, security=self.keys.security("gateway"), limits=limits)
        self.run(servicer.streams.start())
        http = HttpServer(create_app(OpenAIEdge(servicer, info["model_id"], list, lambda: 1)))
        return servicer, http, self.run(http.start("127.0.0.1", 0))

    def body(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, **fields}

    def post(self, body: dict[str, Any], path: str = "/v1/completions", port: int | None = None,
             request_id: str = "") -> tuple[int, dict[str, str], bytes]:
        """One request (to ``port``'s gateway; None: this one's; with ``request_id`` its
        ``X-Request-Id``); its status, headers (lower-case names) and body."""
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=60)
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        if request_id:
            headers["X-Request-Id"] = request_id
        try:
            conn.request("POST", path, json.dumps(body), headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post_raw(self, body: dict[str, Any], request_id: str = "") -> socket.socket:
        """Send one request (with ``request_id`` its ``X-Request-Id``) on a new connection; the
        socket, its reply unread."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        data = json.dumps(body)
        rid = f"X-Request-Id: {request_id}\r\n" if request_id else ""
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.key}\r\n{rid}"
                      f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n{data}").encode())
        return sock

    def stats(self) -> tuple[int, int]:
        """The node's (running, waiting) requests."""
        stats = self.node.stats()
        return stats["running"], stats["waiting"]

    def grpc_call(self, request_id: str, max_tokens: int = 400) -> Any:
        """A Generate call as the gRPC servicer makes it (``generate`` with a gRPC-shaped context
        and ``request_id`` as the client's own), of this tenant, on ``PROMPT``: its events
        (``anext`` them with ``self.run``; a refusal raises ``Refused``)."""
        call_input = GenerateInput(prompt=PROMPT, request_id=request_id,
                                   sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return self.servicer.generate(GrpcContext(self.key), lambda: call_input)

    def in_flight(self) -> int:
        return self.run(call(self.scheduler.stats))["in_flight"]["n0"]

    def usage(self) -> dict[str, int]:
        return self.scheduler.usage.counters(self.tenant_id)

    def block(self, name: str) -> NodeRequest:
        """Admit a request of another tenant (the scheduler counts it in flight until
        ``unblock``), which runs on the node."""
        blocker = NodeRequest(request_id=f"other/{name}", tenant="other", cache_namespace="ns",
                              token_ids=tuple(range(100, 140)),
                              sampling=SamplingParams(max_tokens=200, ignore_eos=True))
        self.run(call(self.servicer.streams.open, blocker.request_id))
        assert self.run(self.servicer.streams.admit(blocker, [])).code == "OK"
        return blocker

    def unblock(self, blocker: NodeRequest) -> None:
        streams = self.servicer.streams
        self.run(call(streams.abort, "n0", blocker.request_id))
        self.run(call(self.scheduler.release, blocker.request_id))
        self.run(call(streams.close, blocker.request_id))

    def holds_nothing(self, blockers: int = 0) -> bool:
        """Nothing of this tenant is being admitted at the gateway, in flight at the scheduler
        (besides ``blockers`` of another tenant's) or on the node."""
        return (not self.servicer.streams._pending and self.in_flight() == blockers
                and not self.servicer.open_streams and not self.servicer._in_flight
                and not any(rid.startswith(f"{self.tenant_id}/") for rid in self.node._streams)
                and self.node.tenant_blocks(self.tenant_id)["requests"] == 0)

    def assert_all_freed(self) -> None:
        """Nothing runs or waits, the scheduler holds nothing, the gateway no stream, and every
        pool block is free (cached ones included), the pool's integrity checked."""
        wait_for(lambda: self.stats() == (0, 0) and self.holds_nothing(), 10.0)
        stats = self.run(self.node.integrity_stats())
        assert stats["integrity_ok"], stats
        assert stats["num_blocks"] - stats["free_blocks"] - stats["cached_blocks"] == 0, stats

    async def close_gateways(self) -> None:
        await self.http.stop()
        self.servicer.streams.shutdown()


@pytest.fixture(scope="module")
def edge() -> Iterator[Edge]:
    e = Edge()
    yield e
    e.close()


def sse_events(raw: bytes) -> list[Any]:
    """A server-sent event body's ``data`` values (JSON, or ``[DONE]``)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_seeded_choices_are_reproducible_differ_and_reuse_the_prompts_kv(edge: Edge) -> None:
    """n=3 with a seed: three choices (index 0..2, each its own finish_reason), the same texts
    on a second call, choice i sampled with seed + i (a single request seeded 8 is choice 1 of
    seed 7), OpenAI's usage (the prompt once, completions summed), and choices 1 and 2 ran on
    choice 0's node with the prompt's full blocks from its prefix cache. The tenant's usage
    counts each choice as a request with its own tokens."""
    before = edge.usage()
    status, _, raw = edge.post(edge.body(n=3, seed=7))
    assert status == 200, raw
    whole = json.loads(raw)
    assert whole["object"] == "text_completion" and whole["id"].startswith("cmpl-")
    choices = whole["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["finish_reason"] for c in choices] == ["length"] * 3
    texts = [c["text"] for c in choices]
    assert len(set(texts)) == 3, texts  # different seeds, different samples
    assert whole["usage"]["prompt_tokens"] == len(PROMPT)
    assert whole["usage"]["completion_tokens"] == 18
    assert whole["usage"]["total_tokens"] == len(PROMPT) + 18
    ran = whole["kvstrata"]["choices"]
    assert [c["node_id"] for c in ran] == ["n0"] * 3
    assert [c["cached_tokens"] for c in ran[1:]] == [REUSED, REUSED]  # choice 0's prompt KV
    wait_for(lambda: edge.usage()["completion_tokens"] - before["completion_tokens"] == 18, 10.0)
    after = edge.usage()
    assert after["requests"] - before["requests"] == 3
    assert after["prompt_tokens"] - before["prompt_tokens"] == 3 * len(PROMPT)

    status, _, raw = edge.post(edge.body(n=3, seed=7))
    assert status == 200 and [c["text"] for c in json.loads(raw)["choices"]] == texts  # reproducible
    status, _, raw = edge.post(edge.body(seed=8))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == texts[1]  # choice 1: seed 7 + 1
    edge.assert_all_freed()


def test_greedy_choices_are_served_and_equal(edge: Edge) -> None:
    """n > 1 at temperature 0 is served, as OpenAI serves it: n equal greedy texts, the same
    as a single greedy request's."""
    status, _, raw = edge.post(edge.body(n=3, temperature=0))
    assert status == 200, raw
    texts = [c["text"] for c in json.loads(raw)["choices"]]
    status, _, raw = edge.post(edge.body(temperature=0))
    assert texts == [json.loads(raw)["choices"][0]["text"]] * 3
    edge.assert_all_freed()


def test_a_stream_interleaves_the_choices_then_finishes_each_then_sums_usage(edge: Edge) -> None:
    """Streamed, n=3: every chunk holds one choice with its index, the choices' text chunks
    interleave as they arrive, each choice ends with one finish chunk after its text, and the
    usage chunk (no choices) comes last, before [DONE], with the completions summed; each
    choice's text is the whole response's for the same seed."""
    body = edge.body(n=3, seed=11, max_tokens=16)
    status, _, raw = edge.post(body)
    assert status == 200
    whole = [c["text"] for c in json.loads(raw)["choices"]]
    status, headers, raw = edge.post({**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 48
    assert usage["usage"]["prompt_tokens"] == len(PROMPT) and len(usage["kvstrata"]["choices"]) == 3
    assert all(len(c["choices"]) == 1 and c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    order = [c["choices"][0]["index"] for c in chunks]
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)]
    assert texts == whole
    finishes = [(k, c["choices"][0]) for k, c in enumerate(chunks) if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for _, f in finishes) == [0, 1, 2]
    for k, finish in finishes:
        assert finish["finish_reason"] == "length" and finish["text"] == ""
        assert finish["index"] not in order[k + 1:]  # nothing of that choice after its finish
    text_order = [i for i, c in zip(order, chunks) if c["choices"][0]["text"]]
    assert text_order != sorted(text_order), text_order  # interleaved, not one choice after another
    edge.assert_all_freed()


def test_each_choice_has_its_own_logprobs_whole_and_streamed(edge: Edge) -> None:
    """n=2 with a completion's ``logprobs`` 2: each choice's log probabilities are its own
    tokens' (as many as it generated, different choices' differ), and a stream's chunks of
    one choice join to that choice's whole list."""
    body = edge.body(n=2, seed=5, logprobs=2)
    status, _, raw = edge.post(body)
    assert status == 200, raw
    whole = [c["logprobs"] for c in json.loads(raw)["choices"]]
    assert [len(w["tokens"]) for w in whole] == [6, 6] and whole[0]["tokens"] != whole[1]["tokens"]
    assert all(len(top) <= 3 for w in whole for top in w["top_logprobs"])
    status, _, raw = edge.post({**body, "stream": True})
    chunks = [e["choices"][0] for e in sse_events(raw)[:-1]]
    streamed = [[t for c in chunks if c["index"] == i and c["logprobs"] for t in c["logprobs"]["tokens"]]
                for i in range(2)]
    assert streamed == [w["tokens"] for w in whole]
    edge.assert_all_freed()


@pytest.mark.parametrize("refusal", ["queue_full", "max_streams_per_tenant"])
def test_a_choice_refused_aborts_the_admitted_ones_and_is_the_response(edge: Edge, refusal: str) -> None:
    """All or nothing: n=3 where the third choice cannot be admitted: the scheduler's queue is
    full (two of the 3 slots are another tenant's and queue_limit is 1: choices 0 and 1 are
    admitted, and choice 2 would pass the tenant's fair share of the places), or the tenant's
    streams at the gateway are capped at 3 and one of its calls is open already. The response
    is that refusal (429 with Retry-After), and the choices admitted before it are aborted:
    nothing of the tenant's runs, waits or holds a block on the node, and the scheduler and the
    gateway hold nothing of it (but the call open before, closed at the end)."""
    blockers = [edge.block(f"refusal-{i}") for i in range(2 if refusal == "queue_full" else 0)]
    queue_limit, streams = edge.scheduler.queue_limit, edge.servicer.max_streams_per_tenant
    open_call = None
    if refusal == "queue_full":
        edge.scheduler.queue_limit = 1
    else:
        edge.servicer.max_streams_per_tenant = 3
        open_call = edge.post_raw(edge.body(max_tokens=400))
        wait_for(lambda: edge.stats() == (1, 0), 10.0)
    before = edge.usage()
    try:
        status, headers, raw = edge.post(edge.body(n=3, seed=1, max_tokens=200))
    finally:
        edge.scheduler.queue_limit, edge.servicer.max_streams_per_tenant = queue_limit, streams
    error = json.loads(raw)["error"]
    assert status == 429 and error["type"] == "rate_limit_error" and int(headers["retry-after"]) >= 1, raw
    assert ("queue full" if refusal == "queue_full" else "max_streams_per_tenant") in error["message"]
    # admitted before the refusal: choices 0 and 1 (the scheduler's); choice 0, and choice 1 when
    # its admission went out before the gateway's cap refused choice 2 (started with it) at once
    admitted = edge.usage()["requests"] - before["requests"]
    assert admitted == 2 if refusal == "queue_full" else admitted in (1, 2)
    assert edge.usage()["rejected"] - before["rejected"] == (refusal == "queue_full")
    if open_call is not None:
        wait_for(lambda: edge.stats() == (1, 0), 10.0)  # only the call open before runs
        open_call.close()
    wait_for(lambda: edge.holds_nothing(len(blockers)), 10.0)
    for blocker in blockers:
        edge.unblock(blocker)
    edge.assert_all_freed()


@pytest.mark.parametrize("when", ["queued", "streaming"])
def test_a_client_gone_aborts_every_choice(edge: Edge, when: str) -> None:
    """A client that disconnects aborts all n: while its fourth choice waits in the node's queue
    (the first three run in its 3 slots; the whole response was asked), or mid-stream once
    every choice has sent text. Every choice leaves the node at once and every block is freed."""
    n = SLOTS + 1 if when == "queued" else 3
    sock = edge.post_raw(edge.body(n=n, max_tokens=400, stream=when == "streaming"))
    if when == "queued":
        wait_for(lambda: edge.stats() == (SLOTS, 1), 10.0)  # choices 0-2 run, choice 3 waits
    else:
        seen, raw = set(), b""
        while seen != {0, 1, 2}:
            data = sock.recv(65536)
            assert data, raw
            raw += data
            seen |= {int(i) for i in re.findall(rb'"index":(\d)', raw)}
    sock.close()
    took = wait_for(lambda: edge.stats() == (0, 0), 10.0)
    assert took < 3.0
    edge.assert_all_freed()


def test_choices_that_cannot_all_start_within_the_idle_deadline_are_refused(edge: Edge) -> None:
    """A started choice's events wait unread while the others wait to start; past the gateway's
    ``stream_idle_timeout_s`` (0.5 s here) its stream is ended and the response's writer
    stopped: the response is a 429 saying so (retryable), and every choice is aborted. Here n=4
    on 3 slots: choice 3 waits for a slot while choices 0-2 run 400 tokens."""
    servicer, http_server, port = edge.gateway(StreamLimits(idle_timeout_s=0.5))
    try:
        status, headers, raw = edge.post(edge.body(n=SLOTS + 1, max_tokens=400), port=port)
        error = json.loads(raw)["error"]
        assert status == 429 and error["type"] == "rate_limit_error" and headers["retry-after"] == "1", raw
        assert error["message"].startswith(f"n: the {SLOTS + 1} choices did not all start in time: "), error
        assert "stream_idle_timeout_s 0.5" in error["message"]
        wait_for(lambda: not servicer.open_streams and not servicer._in_flight and not servicer.streams._pending, 10.0)
        edge.assert_all_freed()
    finally:
        async def stop() -> None:
            await http_server.stop()
            servicer.streams.shutdown()

        edge.run(stop())


@pytest.mark.parametrize(("fields", "message"), [
    ({"n": MAX_N + 1}, f"n: must be an integer in [1, {MAX_N}], got {MAX_N + 1}"),
    ({"n": 0}, f"n: must be an integer in [1, {MAX_N}], got 0"),
    ({"n": 3, "session_id": "s"}, ("n: must be 1 with a session_id (a session keeps one history, which one "
                                  "choice continues), got 3")),
])
def test_n_out_of_range_or_with_a_session_is_a_400_naming_n(edge: Edge, fields: dict, message: str) -> None:
    before = edge.usage()["requests"]
    status, _, raw = edge.post(edge.body(**fields))
    error = json.loads(raw)["error"]
    assert (status, error["param"], error["code"], error["message"]) == (400, "n", "invalid_argument", message)
    assert edge.usage()["requests"] == before  # nothing was admitted


def test_n_above_max_streams_per_tenant_is_a_400_naming_n(edge: Edge) -> None:
    """Regression (review 26d P4): with the gateway's ``max_streams_per_tenant`` at 2, n=3 (its
    choices could never all be open) was the cap's retryable 429 (Retry-After 1), saying the
    tenant "has 2 calls open" when it had none. Now a 400 naming ``n`` and the cap, before any
    choice starts; n=2 is served."""
    before, refused = edge.usage()["requests"], edge.servicer.streams_refused
    streams, edge.servicer.max_streams_per_tenant = edge.servicer.max_streams_per_tenant, 2
    try:
        status, headers, raw = edge.post(edge.body(n=3))
        served, _, served_raw = edge.post(edge.body(n=2))
    finally:
        edge.servicer.max_streams_per_tenant = streams
    error = json.loads(raw)["error"]
    assert (status, error["param"], error["code"], error["message"]) == (
        400, "n", "invalid_argument", ("n: must be at most 2 at this gateway (its max_streams_per_tenant: "
                                       "each choice is one of the tenant's calls open at once), got 3")), raw
    assert "retry-after" not in headers and edge.servicer.streams_refused == refused
    assert served == 200 and len(json.loads(served_raw)["choices"]) == 2, served_raw
    assert edge.usage()["requests"] - before == 2  # the refused body admitted nothing
    edge.assert_all_freed()


@pytest.mark.parametrize(("first", "second"), [(2, 1), (1, 2), (2, 2), (2, "grpc")])
def test_a_request_id_in_flight_is_refused_409_naming_it_whatever_the_n_or_api(edge: Edge, first: int,
                                                                                second: int | str) -> None:
    """Regression (review 26d P1, P2): each choice of an n>1 call held only its own id
    ``<i>_<id>``, so an n=1 call and an n=2 call with the same ``X-Request-Id`` ran at once
    (both 200, one response id), and an n=2 duplicate's 409 named ``0_<id>``, an id the client
    never sent. Now, while a call with the id runs (any n), a second with that id (n 1 or 2, or
    a gRPC call) is refused ALREADY_EXISTS (409) naming the client's id, admitting nothing; the
    id is free again once the first call has ended."""
    rid = f"dup-{first}-{second}"
    sock = edge.post_raw(edge.body(n=first, max_tokens=400), request_id=rid)
    wait_for(lambda: edge.stats() == (first, 0), 10.0)
    before = edge.usage()["requests"]
    message = f"request {rid!r} is in flight already"
    if second == "grpc":
        with pytest.raises(Refused) as refused:
            edge.run(anext(edge.grpc_call(rid)))
        assert (refused.value.code, refused.value.message) == (grpc.StatusCode.ALREADY_EXISTS, message)
    else:
        status, headers, raw = edge.post(edge.body(n=second), request_id=rid)
        error = json.loads(raw)["error"]
        assert (status, error["code"], error["message"], headers["x-request-id"]) == (
            409, "already_exists", message, rid), raw
    assert edge.usage()["requests"] == before and edge.stats() == (first, 0)
    sock.close()
    edge.assert_all_freed()
    status, _, raw = edge.post(edge.body(n=2), request_id=rid)  # the id is free again
    assert status == 200 and json.loads(raw)["id"] == f"cmpl-{rid}", raw
    edge.assert_all_freed()


def test_a_choices_id_never_collides_with_a_clients_own_id(edge: Edge) -> None:
    """Regression (review 26d P1): a gRPC client's own id ``0_abc`` collided with choice 0 of
    an HTTP n=2 call with id ``abc`` (whichever came second was refused, naming ``0_abc``).
    Choices' ids are no call's: both run, in either order."""
    grpc_call = edge.grpc_call("0_abc")
    started = edge.run(anext(grpc_call))
    assert started["type"] == "started" and started["request_id"] == "0_abc"
    status, _, raw = edge.post(edge.body(n=2), request_id="abc")
    assert status == 200 and len(json.loads(raw)["choices"]) == 2, raw
    edge.run(grpc_call.aclose())
    edge.assert_all_freed()

    sock = edge.post_raw(edge.body(n=2, max_tokens=400), request_id="xyz")
    wait_for(lambda: edge.stats() == (2, 0), 10.0)
    grpc_call = edge.grpc_call("1_xyz", max_tokens=4)
    events = [edge.run(anext(grpc_call)) for _ in range(2)]
    assert [e["type"] for e in events] == ["started", "delta"], events
    edge.run(grpc_call.aclose())
    sock.close()
    edge.assert_all_freed()


def test_each_choice_has_its_own_id_and_seed_and_the_shared_routing_key() -> None:
    """``ChoiceInputs``: the body is parsed once; choice i is ``<i>_<id>``, seeded
    ``(seed + i) mod 2**64`` (None stays None), and routed by the body's ``prompt_cache_key``
    or, without one, by a key made from the prompt (the same prompt, the same key)."""
    parsed = []

    def parse(**fields: Any) -> Any:
        def run() -> Any:
            parsed.append(1)
            body = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "n": 3, **fields})
            return dataclasses.replace(body.to_input(list), request_id="rid")
        return run

    inputs = ChoiceInputs(parse(seed=(1 << 64) - 2))
    calls = [inputs.parse_for(i)() for i in range(3)]
    assert len(parsed) == 1
    assert [c.request_id for c in calls] == ["0_rid", "1_rid", "2_rid"]
    assert [c.call_id for c in calls] == ["rid"] * 3  # the body holds "rid" (``hold_call``), not they
    assert [c.sampling.seed for c in calls] == [(1 << 64) - 2, (1 << 64) - 1, 0]
    assert len({c.routing_key for c in calls}) == 1 and calls[0].routing_key == shared_routing_key(calls[0])
    assert ChoiceInputs(parse()).parse_for(2)().sampling.seed is None and choice_seed(None, 5) is None
    assert ChoiceInputs(parse(prompt_cache_key="k")).parse_for(1)().routing_key == "k"
    other = ChoiceInputs(parse(prompt=[1, 2, 4])).parse_for(0)()
    assert other.routing_key != calls[0].routing_key


def test_each_choices_admission_names_the_bodys_other_choices_in_flight(edge: Edge) -> None:
    """The gateway names, in each choice's admission (the data plane's ``sibs``), the request
    ids of the body's other choices in flight, which the scheduler counts as no work ahead
    (``GlobalScheduler._own_body``: only those, so that separate identical requests are work
    ahead of each other, ``tests/test_admission_choices.py``); a request of its own names none.
    The real scheduler's ``admit_and_submit`` is watched, not replaced."""
    seen: list[tuple[str, tuple[str, ...]]] = []
    real = edge.scheduler.admit_and_submit

    def watched(req: NodeRequest, *args: Any) -> Any:
        seen.append((req.request_id, args[4] if len(args) > 4 else ()))
        return real(req, *args)

    edge.scheduler.admit_and_submit = watched
    try:
        status, _, raw = edge.post(edge.body(n=3, temperature=0, max_tokens=64), request_id="sibs")
        assert status == 200, raw
        status, _, raw = edge.post(edge.body(temperature=0), request_id="alone")
        assert status == 200, raw
    finally:
        del edge.scheduler.admit_and_submit
    ids = [rid for rid, _ in seen]
    assert [rid.split("/", 1)[1].split("#")[0] for rid in ids] == ["0_sibs", "1_sibs", "2_sibs", "alone"], ids
    # each later choice names those before it still in flight (choice 0 runs on: 64 tokens)
    assert seen[0][1] == () and seen[3][1] == (), seen
    assert set(seen[1][1]) <= {ids[0]} and set(seen[2][1]) <= {ids[0], ids[1]} and seen[1][1], seen
    edge.assert_all_freed()
