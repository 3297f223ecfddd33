"""Log probabilities from a cache node to a gRPC client: the node's delta events carry one
``logprobs_entry`` per token id, the gateway checks every entry's shape, types and values
(``data_plane.check_event``) and that they are what the request asked
(``check_logprobs_asked``), a bad one ending its own stream alone; a stream's undelivered
deltas coalesce them and count their bytes; a step of many such deltas is split within
``EVENT_LIMITS``; and ``services.convert`` carries ``logprobs`` and ``min_p`` both ways and the
entries into ``GenerateDelta.logprobs``."""

from __future__ import annotations

import asyncio
import math

import pytest
import zmq

from cache_node.outputs import RequestOutput, TokenLogprobs
from cache_node.sampling_params import MAX_LOGPROBS, SamplingParams
from kvstrata.v1 import inference_pb2
from services import data_plane
from services.cache_node_streams import _Stream
from services.convert import generate_event_to_pb, sampling_params_from_pb, sampling_params_to_pb
from services.data_plane_wire import MAX_EVENTS_PER_MESSAGE
from services.gateway_stream_bounds import StreamBuffer, event_bytes
from services.gateway_streams import NodeStreams
from services.node_request import NodeRequest, entry_logprobs, logprobs_entry
from tests.test_data_plane_limits import _Node

ENTRY = [-0.25, 11, -0.25, 7, -1.5, 3, -2.0]  # the token (11) and its top 3, most probable first


def _delta(*entries: list, tokens: list[int] | None = None) -> dict:
    ids = tokens if tokens is not None else [11] * len(entries)
    return {"type": "delta", "token_ids": ids, "text": "x", "logprobs": list(entries)}


def test_an_entry_is_flat_and_reads_back() -> None:
    assert logprobs_entry(-0.25, [(11, -0.25), (7, -1.5), (3, -2.0)]) == ENTRY
    assert entry_logprobs(ENTRY) == (-0.25, [(11, -0.25), (7, -1.5), (3, -2.0)])
    assert logprobs_entry(-3.0, []) == [-3.0] and entry_logprobs([-3.0]) == (-3.0, [])


def test_good_logprobs_pass_the_gateways_check() -> None:
    event = _delta(ENTRY, [-0.0], [float("-inf"), 5, -1e-9] + [n for i in range(19) for n in (100 + i, -1.0 - i)])
    assert data_plane.check_event(event) is event
    assert data_plane.check_event(_delta(tokens=[])) is not None  # a held-back tail: no token, no entry


@pytest.mark.parametrize(("entries", "tokens"), [
    ([ENTRY, ENTRY], [11]),  # two entries for one token id
    ([], [11]),  # none for it
    ([ENTRY[:-1]], [11]),  # an id without its logprob
    ([[-0.5] + [1, -1.0] * (MAX_LOGPROBS + 1)], [11]),  # past MAX_LOGPROBS
    ([[-0.5, 1.0, -1.0]], [11]),  # a float id
    ([[-0.5, True, -1.0]], [11]),  # a bool id
    ([[-0.5, -1, -1.0]], [11]),  # a negative id
    ([[-0.5, 1 << 31, -1.0]], [11]),  # past MAX_TOKEN_ID
    ([[-0.5, 1, -1.0, 1, -2.0]], [11]),  # the same id twice
    ([[math.nan]], [11]),  # NaN
    ([[0.5]], [11]),  # a positive logprob
    ([[0]], [11]),  # an integer, not a float
    ([[-0.5, 1, -2.0, 2, -1.0]], [11]),  # top out of order
    (["-0.5"], [11]),  # not an array
    ([{"logprob": -0.5}], [11]),
])
def test_malformed_logprobs_are_refused_naming_the_field(entries: list, tokens: list[int]) -> None:
    with pytest.raises((TypeError, ValueError), match="event.logprobs"):
        data_plane.check_event({"type": "delta", "token_ids": tokens, "text": "", "logprobs": entries})


def test_logprobs_on_another_event_or_not_a_list_are_refused() -> None:
    finished = {"type": "finished", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1,
                "logprobs": []}
    with pytest.raises(ValueError, match="event.logprobs"):
        data_plane.check_event(finished)
    with pytest.raises(TypeError, match="event.logprobs"):
        data_plane.check_event({"type": "delta", "token_ids": [1], "text": "", "logprobs": {"1": -1.0}})


@pytest.mark.parametrize(("event", "asked", "good"), [
    (_delta(ENTRY), 3, True), (_delta(ENTRY), 2, False), (_delta(ENTRY), None, False),
    (_delta([-0.5]), 0, True), ({"type": "delta", "token_ids": [11], "text": "x"}, None, True),
    ({"type": "delta", "token_ids": [11], "text": "x"}, 3, False), (_delta(tokens=[]), 3, True),
    ({"type": "delta", "token_ids": [], "text": "tail"}, 3, True),
    ({"type": "finished", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1}, 3, True),
])
def test_a_delta_must_give_what_its_request_asked(event: dict, asked: int | None, good: bool) -> None:
    if good:
        data_plane.check_logprobs_asked(event, asked)
    else:
        with pytest.raises(ValueError, match="event.logprobs"):
            data_plane.check_logprobs_asked(event, asked)


def test_undelivered_deltas_coalesce_their_logprobs_and_count_their_bytes() -> None:
    """Three deltas (one a held-back tail without tokens) become one with both entries in
    order, ids back as integers; each entry counts 8 per number and 4 (``event_bytes``)."""
    buffer = StreamBuffer()
    other = [-1.0, 7, -0.5, 11, -1.0, 3, -2.0]
    events = [_delta(ENTRY), {"type": "delta", "token_ids": [], "text": "y"}, _delta(other, tokens=[7])]
    for event in events:
        buffer.put_nowait(event)
    assert buffer.undelivered_bytes == sum(event_bytes(e) for e in events) == 4 * (1 + 1 + 1 + 1 + 1) + 2 * (8 * 7 + 4)
    got = buffer.get_nowait()
    assert got == {"type": "delta", "token_ids": [11, 7], "text": "xyx", "logprobs": [ENTRY, other]}
    assert all(type(t) is int for entry in got["logprobs"] for t in entry[1::2])
    assert buffer.undelivered_bytes == 0
    buffer.put_nowait({"type": "delta", "token_ids": [1], "text": "z"})
    assert "logprobs" not in buffer.get_nowait()


def test_a_step_of_many_logprobs_deltas_is_split_within_the_event_limits() -> None:
    """A step ending a third of ``MAX_EVENTS_PER_MESSAGE`` streams that each asked for 20
    logprobs (their last delta, a held-back tail, ``finished`` with 16 policy figures): more
    elements than one message takes, so the node sends several, each decoding within
    ``EVENT_LIMITS`` with every event good, all in order."""
    top = [n for i in range(MAX_LOGPROBS) for n in (1000 + i, -0.5 - i)]
    finished = {"type": "finished", "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 7,
                "cached_tokens": {"device": 1, "host": 2, "spill_ram": 3, "spill_disk": 4}, "ttft_ms": 1.0,
                "tpot_ms": 2.0, "preempted": False, "prefill_tokens_per_s": 1.0, "step_s": 0.1,
                "policy_stats": {f"figure{k}": 1.0 for k in range(16)}}
    items = []
    for i in range(MAX_EVENTS_PER_MESSAGE // 3):
        rid = f"tenant/r{i}#1"
        items += [[rid, {"type": "delta", "token_ids": [1000], "text": " w", "logprobs": [[-0.5, *top]]}],
                  [rid, {"type": "delta", "token_ids": [], "text": "x" * 255}], [rid, finished]]
    messages = list(data_plane.event_messages(items))
    assert len(messages) > 1
    decoded = [data_plane.event_items(data_plane.unpack(m, data_plane.EVENT_LIMITS)) for m in messages]
    assert [[rid, event] for message in decoded for rid, event in message] == items


def test_a_node_streams_logprobs_and_a_malformed_event_ends_its_own_stream_alone() -> None:
    """On the real gateway inbox (``NodeStreams``) and a node's real ``Streams`` over ZeroMQ:
    a stream asking for 2 logprobs gets its entries; then one message holds a delta with a
    NaN logprob for one stream, a delta with more entries than its request asked for a
    second, and a good delta for a third: the first two end UNAVAILABLE (counted in
    ``bad_messages``), the third gets its delta, and the gateway reads on."""

    async def run() -> None:
        streams = NodeStreams({}, {}, "tcp://127.0.0.1:1", security=None)
        await streams.start()
        node = _Node()
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(streams.subscriber)
        try:
            buffers = {rid: streams.open(rid, logprobs=2) for rid in ("t/a#1", "t/b#1", "t/c#1")}
            plain = streams.open("t/d#1")
            for rid in buffers:
                streams.bind(rid, "n1")
            streams.bind("t/d#1", "n1")
            req = NodeRequest(request_id="t/a#1", tenant="t", cache_namespace="ns",
                              sampling=SamplingParams(max_tokens=8, logprobs=2))
            node._streams["t/a#1"] = node._engine_streams["t/a#1"] = _Stream(None, None, req, 5, streams.subscriber)
            lp = TokenLogprobs(-0.1, ((9, -0.1), (4, -2.5)))
            node._deliver_step([RequestOutput("t/a#1", (9,), False, None, 5, 1, 0, 0, 0.01, logprobs=(lp,))])
            event = await asyncio.wait_for(buffers["t/a#1"].get(), 30)
            assert event == {"type": "delta", "token_ids": [9], "text": "", "logprobs": [[-0.1, 9, -0.1, 4, -2.5]]}
            push.send(data_plane.pack([
                ["t/a#1", _delta([math.nan, 9, -0.1, 4, -2.5], tokens=[9])],
                ["t/b#1", _delta(ENTRY)],  # 3 top entries; its request asked 2
                ["t/c#1", _delta([-0.1, 9, -0.1, 4, -2.5], tokens=[9])],
                ["t/d#1", {"type": "delta", "token_ids": [5], "text": "ok"}],
            ]))
            for rid in ("t/a#1", "t/b#1"):
                ended = await asyncio.wait_for(buffers[rid].get(), 30)
                assert ended["type"] == "error" and ended["code"] == "UNAVAILABLE", ended
                assert "event.logprobs" in ended["message"]
            assert (await asyncio.wait_for(buffers["t/c#1"].get(), 30))["logprobs"] == [[-0.1, 9, -0.1, 4, -2.5]]
            assert (await asyncio.wait_for(plain.get(), 30)) == {"type": "delta", "token_ids": [5], "text": "ok"}
            assert streams.bad_messages == 2
            push.send(data_plane.pack([["t/c#1", _delta([-0.3, 2, -0.3, 1, -0.9], tokens=[2])]]))
            assert (await asyncio.wait_for(buffers["t/c#1"].get(), 30))["token_ids"] == [2]
        finally:
            push.close(0)
            ctx.term()
            node._pusher.close()
            streams.shutdown()

    asyncio.run(run())


def test_grpc_sampling_params_carry_logprobs_and_min_p_both_ways() -> None:
    for params in (SamplingParams(max_tokens=8, logprobs=MAX_LOGPROBS, min_p=0.05),
                   SamplingParams(max_tokens=8, logprobs=0), SamplingParams(max_tokens=8)):
        msg = inference_pb2.SamplingParams.FromString(sampling_params_to_pb(params).SerializeToString())
        assert sampling_params_from_pb(msg) == params
    old = inference_pb2.SamplingParams(max_tokens=8)  # an older client: neither field
    assert (sampling_params_from_pb(old).logprobs, sampling_params_from_pb(old).min_p) == (None, 0.0)


@pytest.mark.parametrize(("fields", "field"), [
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"), ({"logprobs": (1 << 32) - 1}, "logprobs"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.5}, "min_p"), ({"min_p": math.nan}, "min_p"),
    ({"min_p": math.inf}, "min_p"),
])
def test_grpc_out_of_range_values_are_refused_naming_the_field(fields: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^sampling\.{field} must"):
        sampling_params_from_pb(inference_pb2.SamplingParams(max_tokens=8, **fields))


def test_a_delta_with_logprobs_becomes_generate_delta_logprobs() -> None:
    event = _delta(ENTRY, [-3.0], tokens=[11, 12])
    delta = inference_pb2.GenerateResponse.FromString(generate_event_to_pb(event).SerializeToString()).delta
    assert list(delta.token_ids) == [11, 12] and len(delta.logprobs) == 2
    first, second = delta.logprobs
    assert first.logprob == pytest.approx(-0.25)
    assert [(t.token_id, t.logprob) for t in first.top] == [(11, -0.25), (7, -1.5), (3, -2.0)]
    assert second.logprob == -3.0 and not second.top
    assert not generate_event_to_pb({"type": "delta", "token_ids": [1], "text": "a"}).delta.logprobs
