"""Each data-plane message is decoded within its socket's ``MessageLimits`` (``data_plane.unpack``):
what a message may expand to is bounded before it is built, and the largest real message of
each kind still decodes.

Regression (review 25a B): ``unpack`` was ``msgpack.unpackb`` with its default limits, which allow
as many elements as the message has bytes: one byte (``0x80``, an empty map) became a 64-byte
dict, so one 32 MiB message to the gateway's event inbox became 2.3 GiB of Python objects and
stalled its event loop (every tenant's streams and admissions) for 5.7 s before any check ran.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
import tracemalloc
import types
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq

from cache_node.outputs import RequestOutput
from cache_node.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from cache_node.scheduling.admission import Ewma, SpeedMeter
from cache_node.structured_output import MAX_STRUCTURED_SPEC_BYTES, StructuredOutputSpec
from services import convert, data_plane, data_plane_wire
from services.cache_node_health import Health
from services.cache_node_streams import Streams, _Stream
from services.data_plane_wire import MAX_EVENTS_PER_MESSAGE, MAX_WIRE_TOKENS, MessageLimits
from services.gateway_streams import NodeStreams
from services.node_request import NodeRequest

LIMITS = [data_plane.REQUEST_LIMITS, data_plane.EVENT_LIMITS, data_plane.REPLY_LIMITS]
MIB = 1 << 20


def bomb(size: int) -> bytes:
    """The review's message: one array32 of ``size`` - 5 empty maps."""
    return b"\xdd" + struct.pack(">I", size - 5) + b"\x80" * (size - 5)


def costs(work: Callable[[], Any]) -> tuple[BaseException | None, float, int]:
    """(what ``work()`` raised, its seconds, the peak of Python memory it allocated)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        work()
        raised = None
    except Exception as exc:  # noqa: BLE001 - returned to the test
        raised = exc
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return raised, seconds, peak


@pytest.mark.parametrize("limits", LIMITS, ids=["request", "event", "reply"])
def test_the_reviews_bomb_is_refused_before_it_is_built(limits: MessageLimits) -> None:
    """16 MiB of empty maps in one array (1.14 GiB and 2.4 s before) is refused at its header."""
    payload = bomb(16 * MIB)
    raised, seconds, peak = costs(lambda: data_plane.unpack(payload, limits))
    assert isinstance(raised, ValueError) and "max_array_len" in str(raised)
    assert peak < MIB and seconds < 0.5


@pytest.mark.parametrize("limits", LIMITS, ids=["request", "event", "reply"])
def test_many_small_containers_stop_at_the_bound(limits: MessageLimits) -> None:
    """Each array within ``max_array_len`` and many of them (a nested bomb, ~12 M empty maps and
    arrays in 12 MiB): decoding stops at ``max_containers``, having built at most that many."""
    width = max(min(limits.max_array_len, 4096), 1)
    nested = msgpack.packb([[{}] * width] * (12 * MIB // width))
    raised, _, peak = costs(lambda: data_plane.unpack(nested, limits))
    assert isinstance(raised, ValueError)
    assert peak < 16 * MIB  # the old unpack: ~0.9 GiB


@pytest.mark.parametrize("limits", LIMITS[1:], ids=["event", "reply"])
def test_many_small_strings_stop_at_the_bound(limits: MessageLimits) -> None:
    """2-character strings (~20 bytes of objects a byte) stop at ``max_elements``. (A request's
    bound is 8.7 M elements: a real admission carries 4.3 M token ids and as many hashes.)"""
    width = max(min(limits.max_array_len, 4096), 1)
    strings = msgpack.packb([["ab"] * width] * (12 * MIB // (3 * width)))
    raised, _, peak = costs(lambda: data_plane.unpack(strings, limits))
    assert isinstance(raised, ValueError) and peak < 80 * MIB  # the old unpack: ~250 MiB


def test_no_extension_type_and_no_message_over_the_cap() -> None:
    for limits in LIMITS:
        with pytest.raises(ValueError, match="max_ext_len"):
            data_plane.unpack(msgpack.packb(msgpack.Timestamp(1)), limits)
        with pytest.raises(ValueError, match="bytes"):
            data_plane.unpack(b"\xc0" * (limits.max_bytes + 1), limits)


def test_the_limits_are_the_gateways_own_bounds() -> None:
    """The request limits hold what the gateway admits (``services.convert``), not copies that
    drift: 1 Mi characters of chat, 1,024 messages, token prompts."""
    assert data_plane_wire._PROMPT_CHARS == convert.MAX_PROMPT_CHARS
    assert data_plane_wire._CHAT_MESSAGES == convert.MAX_CHAT_MESSAGES
    assert convert.MAX_PROMPT_TOKEN_IDS < MAX_WIRE_TOKENS
    assert data_plane.REQUEST_LIMITS.max_str_len == 4 * convert.MAX_PROMPT_CHARS


def largest_request(**fields: Any) -> NodeRequest:
    sampling = SamplingParams(max_tokens=5, stop=("\U0001f600" * MAX_STOP_STRING_CHARS,) * MAX_STOP_STRINGS,
                              stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)),
                              logit_bias={(1 << 30) + i: -99.5 for i in range(MAX_LOGIT_BIAS_TOKENS)},
                              allowed_token_ids=tuple(range(1 << 30, (1 << 30) + MAX_ALLOWED_TOKEN_IDS)),
                              structured_output=StructuredOutputSpec("grammar", "\U0001f600" * (MAX_STRUCTURED_SPEC_BYTES // 4)))
    extra = {"slo_class": "x", "ttft_slo_ms": "1", "min_tokens_per_s": "1", "weight": "1", "kv_quota_bytes": "1",
             "fill_context": "1", "routing_key": "r" * 1024, "prompt_tokens_estimate": "1"}
    return NodeRequest(request_id="t/" + "r" * 1000, tenant="t" * 1000, cache_namespace="n#salt=" + "s" * 1000,
                       sampling=sampling, extra=extra, policy="p" * 63, priority=-1000, **fields)


def test_the_largest_real_requests_decode() -> None:
    """An admission of ``MAX_WIRE_TOKENS`` token ids (the tokens of 1 Mi 4-byte characters) of
    5 bytes each and a block hash each 16 tokens (29 MiB), and a session turn's submit of 1,024
    chat messages holding 1 Mi 4-byte characters, decode and pass ``request_from_wire``."""
    req = largest_request(token_ids=(1 << 30,) * MAX_WIRE_TOKENS)
    hashes = [b"h" * 32] * (MAX_WIRE_TOKENS // 16)
    payload = data_plane.pack({"id": 1, "req": data_plane.request_to_wire(req), "sub": "tcp://10.0.0.1:50000",
                               "hashes": hashes})
    msg = data_plane.unpack(payload)
    assert data_plane.request_from_wire(msg["req"]) == req and msg["hashes"] == hashes
    wide = "\U0001f600"
    messages = ({"role": "user", "content": wide * (convert.MAX_PROMPT_CHARS - convert.MAX_CHAT_MESSAGES + 1)},
                *({"role": "assistant", "content": wide} for _ in range(convert.MAX_CHAT_MESSAGES - 1)))
    turn = largest_request(messages=messages, session_id="t/" + "s" * 1000)
    payload = data_plane.pack({"op": "submit", "req": data_plane.request_to_wire(turn), "sub": "tcp://10.0.0.1:5"})
    assert data_plane.request_from_wire(data_plane.unpack(payload)["req"]) == turn
    for op in ({"op": "abort", "id": "t/r"}, {"op": "abort_subscriber", "sub": "tcp://a:1"},
               {"op": "end_tenant", "tenant": "t"}, {"op": "close_session", "session": "t/s", "tenant": "t",
                                                    "turns": [f"t/r#{i}" for i in range(64)]}):
        assert data_plane.unpack(data_plane.pack(op)) == op


def test_the_largest_real_event_message_and_reply_decode() -> None:
    """A step's message for a third of ``MAX_EVENTS_PER_MESSAGE`` streams, each ending in it
    (its last token's delta, a held-back stop-string tail, ``finished`` with every tier and 16
    policy figures), and a ``started`` for every one; an admission reply at every bound."""
    rid = "tenant/" + "r" * 256 + "#1"
    finished = {"type": "finished", "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 7,
                "cached_tokens": {"device": 1, "host": 2, "spill_ram": 3, "spill_disk": 4}, "ttft_ms": 1.0,
                "tpot_ms": 2.0, "preempted": False, "prefill_tokens_per_s": 1.0, "step_s": 0.1,
                "policy_stats": {f"figure{k}": 1.0 for k in range(16)}}
    step = []
    for i in range(MAX_EVENTS_PER_MESSAGE // 3):
        step += [[f"{rid}{i}", {"type": "delta", "token_ids": [1 << 20], "text": " word"}],
                 [f"{rid}{i}", {"type": "delta", "token_ids": [], "text": "x" * 255}], [f"{rid}{i}", finished]]
    items = data_plane.event_items(data_plane.unpack(data_plane.pack(step), data_plane.EVENT_LIMITS))
    assert len(items) == len(step) and items[-1][1] == finished
    started = [[f"{rid}{i}", {"type": "started", "request_id": f"{rid}{i}", "node_id": "n" * 1024, "prompt_tokens": 5,
                              "cached_tokens": finished["cached_tokens"], "queue_ms": 1.0, "priority": -1000}]
               for i in range(MAX_EVENTS_PER_MESSAGE)]
    assert len(data_plane.event_items(data_plane.unpack(data_plane.pack(started), data_plane.EVENT_LIMITS))) == len(started)
    adm = {"node_id": "n" * 1024, "code": "RESOURCE_EXHAUSTED", "message": "m" * 100_000, "retry_after_s": 1.0,
           "spill_blocks": 1, "reason": "", "continues_session": False}
    for reply in ({"id": 1, "adm": adm}, {"id": None, "error": "e" * 100_000}):
        assert data_plane.unpack(data_plane.pack(reply), data_plane.REPLY_LIMITS) == reply


def test_a_bomb_at_the_gateways_event_inbox_costs_little_and_delays_no_one() -> None:
    """The review's repro on the real ``NodeStreams`` inbox: a node pushes an 8 MiB bomb, then
    another tenant's delta. The bomb is dropped and counted, the delta delivered, and the
    gateway's Python memory grows by the message's bytes, not ~70 times them (~570 MiB)."""

    async def run() -> None:
        streams = NodeStreams({}, {}, "tcp://127.0.0.1:1", security=None)
        await streams.start()
        buffer = streams.open("tenantB/r#1")
        streams.bind("tenantB/r#1", "n1")
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(streams.subscriber)
        await asyncio.sleep(0.1)
        tracemalloc.start()
        push.send(bomb(8 * MIB))
        push.send(data_plane.pack([["tenantB/r#1", {"type": "delta", "token_ids": [1], "text": "a"}]]))
        event = await asyncio.wait_for(buffer.get(), 60)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert event == {"type": "delta", "token_ids": [1], "text": "a"} and streams.bad_messages == 1
        assert peak < 24 * MIB
        push.close(0)
        ctx.term()
        streams.shutdown()

    asyncio.run(run())


class _Node(Streams, Health):
    """A cache node's stream delivery and failure path (the real ``Streams`` and ``Health``)
    pushing over real ZeroMQ: no engine, no model."""

    def __init__(self) -> None:
        self.node_id, self.tokenizer, self.failure = "cache_node_0", None, ""
        scheduler = types.SimpleNamespace(prefill_speed=SpeedMeter(), step_s=Ewma(0.05))
        self.engine = types.SimpleNamespace(scheduler=scheduler)
        self.config = types.SimpleNamespace(step_idle_wait_s=0.0)
        self._streams, self._session_turns, self._outbox, self._engine_streams = {}, {}, deque(), {}
        self._incoming, self._aborts, self._admin, self._health_waiters = deque(), deque(), deque(), []
        self._wake, self._stopped, self._streams_lock = threading.Event(), False, threading.Lock()
        self._pusher = data_plane.PushSockets()

    def open_stream(self, rid: str, subscriber: str) -> None:
        req = NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", sampling=SamplingParams(max_tokens=8))
        self._streams[rid] = self._engine_streams[rid] = _Stream(None, None, req, 5, subscriber)  # as started

    def _after_failure(self) -> None:
        self._stopped = True  # one round of ``_fail`` (the actor would exit here)


def test_a_nodes_messages_past_the_event_limits_reach_the_gateway_whole() -> None:
    """Review 25c 1 on the real gateway inbox (``NodeStreams``): a step that ends more streams
    than one message of ``MAX_EVENTS_PER_MESSAGE`` events holds (a delta and ``finished`` each),
    and a failed node's UNAVAILABLE for more streams than that (``Health._fail``, with refusals
    waiting in its outbox), reach every stream, in order. Before, each went as one message,
    which the inbox refused whole (``max_array_len``): every stream in it waited for ever."""
    ending, failing = MAX_EVENTS_PER_MESSAGE // 2 + 1, MAX_EVENTS_PER_MESSAGE + 1

    async def run() -> None:
        streams = NodeStreams({}, {}, "tcp://127.0.0.1:1", security=None)
        await streams.start()
        node = _Node()
        try:
            ids = [f"t/r#{i}" for i in range(failing + 1)]
            buffers = {rid: streams.open(rid) for rid in ids}
            for rid in ids[:ending]:
                node.open_stream(rid, streams.subscriber)
            node._deliver_step([RequestOutput(rid, (7,), True, "length", 5, 8, 0, 0, 0.01, tuple(range(8)),
                                              {"device": 0}, 0, {}) for rid in ids[:ending]])
            for rid in ids[:ending]:
                delta = await asyncio.wait_for(buffers[rid].get(), 30)
                assert delta["type"] == "delta" and delta["token_ids"] == [7]
                assert (await buffers[rid].get())["type"] == "finished"
            for rid in ids[ending:failing]:
                node.open_stream(rid, streams.subscriber)
            node._outbox.append((streams.subscriber, ids[failing], {"type": "error", "code": "ABORTED", "message": "m"}))
            node._fail("cache node cache_node_0: step loop failed: RuntimeError: CUDA error")
            for rid in ids[ending:failing]:
                assert (await asyncio.wait_for(buffers[rid].get(), 30))["code"] == "UNAVAILABLE"
            assert (await asyncio.wait_for(buffers[ids[failing]].get(), 30))["code"] == "ABORTED"
            assert streams.bad_messages == 0
        finally:
            node._pusher.close()
            streams.shutdown()

    asyncio.run(run())


def test_a_failed_nodes_reason_is_cut_so_its_unavailable_events_decode() -> None:
    """A step loop's exception text past ``EVENT_LIMITS.max_str_len`` (1 MiB) is cut at the node
    (``Health._fail``): it made the node's every UNAVAILABLE message undecodable at its gateway."""

    async def run() -> None:
        streams = NodeStreams({}, {}, "tcp://127.0.0.1:1", security=None)
        await streams.start()
        node = _Node()
        try:
            buffers = {rid: streams.open(rid) for rid in ("t/r#1", "t/r#2")}
            for rid in buffers:
                node.open_stream(rid, streams.subscriber)
            node._fail("cache node cache_node_0: step loop failed: RuntimeError: " + "x" * (2 << 20))
            for buffer in buffers.values():
                event = await asyncio.wait_for(buffer.get(), 30)
                assert event["code"] == "UNAVAILABLE" and event["message"].startswith("cache node cache_node_0")
            assert len(node.failure) <= data_plane.MAX_TEXT_CHARS and streams.bad_messages == 0
        finally:
            node._pusher.close()
            streams.shutdown()

    asyncio.run(run())


def test_event_messages_split_within_every_bound_of_the_limits_in_order() -> None:
    """``event_messages`` under small limits: each message decodes within them (items, arrays
    and maps, elements, bytes), the messages hold the items in order, and a message that fits
    goes whole."""
    delta = {"type": "delta", "token_ids": [1, 2], "text": "ab"}
    finished = {"type": "finished", "cached_tokens": {"device": 1}, "policy_stats": {f"k{j}": 1.0 for j in range(9)}}
    items = [[f"r{i}", delta if i % 3 else finished] for i in range(500)]
    for limits in (MessageLimits(50, 32, 1 << 10, 0, 1 << 20, 1 << 20, max_bytes=1 << 20),  # items
                   MessageLimits(1 << 10, 32, 1 << 10, 0, 30, 1 << 20, max_bytes=1 << 20),  # arrays and maps
                   MessageLimits(1 << 10, 32, 1 << 10, 0, 1 << 20, 300, max_bytes=1 << 20),  # elements
                   MessageLimits(1 << 10, 32, 1 << 10, 0, 1 << 20, 1 << 20, max_bytes=2000)):  # bytes
        messages = list(data_plane.event_messages(items, limits))
        assert len(messages) > 2
        decoded = [data_plane.unpack(message, limits) for message in messages]
        assert [item for message in decoded for item in message] == items
    assert list(data_plane.event_messages(items[:40])) == [data_plane.pack(items[:40])]
