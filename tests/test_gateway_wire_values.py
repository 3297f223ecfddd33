"""The values of the data-plane messages the gateway receives are checked at the wire
(security review D), on the real ``NodeStreams`` and ``InferenceServicer`` over real ZeroMQ
sockets: an admission reply with bad values fails that request alone with UNAVAILABLE at once
(counted in ``bad_messages``, aborted on the gateway's nodes, released), never a hang or an
internal error; a node event with bad values ends its own stream with UNAVAILABLE while the
other events of its message are delivered."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from kvstrata.v1 import inference_pb2
from services import data_plane
from services.gateway import InferenceServicer, input_from_pb
from services.global_scheduler_checks import REJECT_REASONS
from tenants.model import Tenant, TenantSpec
from tests.gateway_harness import NODE_INFO
from tests.grpc_context import GrpcContext, Refused
from tests.test_gateway_stream_bounds import (
    ADMITTED,
    FINISHED,
    STARTED,
    Auth,
    Plane,
    delta,
)


class Trailing(GrpcContext):
    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = tuple(metadata)


async def _call(reply: dict[str, Any]) -> tuple[Any, Trailing, Plane, list[str], float]:
    """One Generate call against a scheduler answering ``reply``: (what it raised or its
    first event, its context, the plane, the releases, the seconds it took)."""
    plane = await Plane().start(reply)
    released: list[str] = []
    scheduler = SimpleNamespace(release=SimpleNamespace(remote=lambda request_id, usage=None: released.append(request_id)))
    auth = Auth()
    servicer = InferenceServicer(scheduler, auth, {"n0": None}, {"n0": {**NODE_INFO, "data_address": plane.node_address}},
                                 None, plane.sched_address)
    plane.streams = servicer.streams
    await servicer.streams.start()
    context = Trailing()
    auth.tenant_of[id(context)] = Tenant("a1", TenantSpec(name="ann"), 0.0)
    pb = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2, 3]),
                                       sampling=inference_pb2.SamplingParams(max_tokens=2))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        outcome: Any = await asyncio.wait_for(servicer.generate(context, lambda: input_from_pb(pb)).__anext__(), 5)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        outcome = exc
    return outcome, context, plane, released, loop.time() - t0


BAD_ADMISSIONS = {
    "retry_after_s inf": {"code": "RESOURCE_EXHAUSTED", "retry_after_s": math.inf, "node_id": ""},
    "retry_after_s nan": {"code": "RESOURCE_EXHAUSTED", "retry_after_s": math.nan, "node_id": ""},
    "retry_after_s -5": {"code": "RESOURCE_EXHAUSTED", "retry_after_s": -5.0, "node_id": ""},
    "retry_after_s 1e9": {"code": "RESOURCE_EXHAUSTED", "retry_after_s": 1e9, "node_id": ""},
    "OK on an unknown node": {"node_id": "nX"},
    "spill_blocks -1": {"spill_blocks": -1},
    "an unknown reason": {"code": "RESOURCE_EXHAUSTED", "reason": "x" * 40, "node_id": ""},
}


@pytest.mark.parametrize("name", list(BAD_ADMISSIONS))
def test_an_admission_reply_with_bad_values_fails_its_request_unavailable_at_once(name: str) -> None:
    """Regression (security review D): ``admission_reply`` checked types only and the gateway
    trusted the values: retry_after_s inf or NaN raised (OverflowError/ValueError: an
    internal error instead of its RESOURCE_EXHAUSTED), -5 went out as retry-after-ms -5000,
    and an OK naming a node the gateway does not know waited forever (the cancel then raised
    KeyError). Now each is a scheduler fault: UNAVAILABLE for that call within the test's 5 s
    (not the 30 s admission timeout), counted in ``bad_messages``, the request aborted on
    every node the gateway knows and released at the scheduler."""

    async def run() -> None:
        outcome, context, plane, released, took_s = await _call({"adm": {**ADMITTED, **BAD_ADMISSIONS[name]}})
        assert isinstance(outcome, Refused) and outcome.code == grpc.StatusCode.UNAVAILABLE, outcome
        assert "malformed admission reply" in str(outcome) and took_s < 5
        assert plane.streams.bad_messages == 1 and not hasattr(context, "trailing")
        assert await plane.aborts() == [{"op": "abort", "id": plane.admitted[0]}]
        assert released == plane.admitted
        plane.close()

    asyncio.run(run())


def test_a_sound_refusal_keeps_its_status_and_retry_after() -> None:
    """What the checks keep: a RESOURCE_EXHAUSTED with retry_after_s 1.5 is that status with
    ``retry-after-ms`` 1500, no bad message, nothing aborted."""

    async def run() -> None:
        refusal = {**ADMITTED, "node_id": "", "code": "RESOURCE_EXHAUSTED", "message": "queue full",
                   "retry_after_s": 1.5, "reason": "queue_full"}
        outcome, context, plane, released, _ = await _call({"adm": refusal})
        assert isinstance(outcome, Refused) and outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(outcome) == "queue full" and context.trailing == (("retry-after-ms", "1500"),)
        assert plane.streams.bad_messages == 0 and await plane.aborts() == [] and released == []
        plane.close()

    asyncio.run(run())


def test_a_long_scheduler_message_is_cut_not_refused() -> None:
    async def run() -> None:
        refusal = {**ADMITTED, "node_id": "", "code": "RESOURCE_EXHAUSTED", "message": "m" * 100_000}
        outcome, _, plane, _, _ = await _call({"adm": refusal})
        assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED and len(str(outcome)) == data_plane.MAX_TEXT_CHARS
        plane.close()

    asyncio.run(run())


BAD_EVENTS = {
    "token id -1": {"type": "delta", "token_ids": [-1], "text": ""},
    "token id 2**40": {"type": "delta", "token_ids": [2**40], "text": ""},
    "prompt_tokens -3": {**STARTED, "prompt_tokens": -3},
    "queue_ms nan": {**STARTED, "queue_ms": math.nan},
    "priority 5000": {**STARTED, "priority": 5000},
    "completion_tokens -1": {**FINISHED, "completion_tokens": -1},
    "ttft_ms inf": {**FINISHED, "ttft_ms": math.inf},
    "cached_tokens -1": {**FINISHED, "cached_tokens": {"device": -1}},
    "cached_tokens of an unknown tier": {**FINISHED, "cached_tokens": {"gpu9": 3}},
    "a made-up finish_reason": {**FINISHED, "finish_reason": "x" * 40},
    "finish_reason error": {**FINISHED, "finish_reason": "error"},
    "error code OK": {"type": "error", "code": "OK", "message": "fine"},
}


@pytest.mark.parametrize("name", list(BAD_EVENTS))
def test_a_node_event_with_bad_values_ends_its_own_stream_unavailable(name: str) -> None:
    """Regression (security review D): node events were checked for types only, so these
    values reached the stream (and failed there, in a protobuf uint32 or a metrics counter,
    or passed on as garbage), and a bad event dropped its whole message, leaving the other
    streams in it waiting. Now the bad event's stream ends UNAVAILABLE (counted once), and the
    other stream of the same message gets its events."""

    async def run() -> None:
        plane = await Plane().start()
        await plane.streams.start()
        bad, good = plane.streams.open("bad"), plane.streams.open("good")
        plane.streams.bind("bad", "n0")
        plane.streams.bind("good", "n0")
        await plane.send([["good", STARTED], ["bad", BAD_EVENTS[name]], ["good", delta(1)], ["good", FINISHED]],
                         lambda: good.qsize() == 3)
        error = bad.get_nowait()
        assert (error["type"], error["code"]) == ("error", "UNAVAILABLE") and "malformed event" in error["message"]
        assert [good.get_nowait() for _ in range(3)] == [STARTED, delta(1), FINISHED]
        assert plane.streams.bad_messages == 1
        plane.close()

    asyncio.run(run())


def test_an_error_event_s_long_message_is_cut_and_keeps_its_code() -> None:
    event = {"type": "error", "code": "INVALID_ARGUMENT", "message": "x" * 10_000}
    [(_, checked)] = data_plane.event_items([["r", event]])
    assert checked["code"] == "INVALID_ARGUMENT" and len(checked["message"]) == data_plane.MAX_TEXT_CHARS


def test_an_abort_on_an_unknown_node_is_logged_not_raised() -> None:
    """Regression (security review D): ``NodeStreams.abort`` on a node the gateway does not
    know raised KeyError (in ``_attempt``'s ``finally``, after an OK naming such a node)."""

    async def run() -> None:
        plane = await Plane().start()
        await plane.streams.start()
        plane.streams.abort("nX", "r")
        plane.streams.abort("n0", "r")
        assert await plane.aborts() == [{"op": "abort", "id": "r"}]
        plane.close()

    asyncio.run(run())


def test_every_reason_the_scheduler_gives_is_one_the_gateway_accepts() -> None:
    """``admission_reply`` refuses a ``reason`` outside ``REJECT_REASONS`` (a metric label):
    every reason the scheduler's code names must be in it."""
    named = set()
    for path in Path("services").glob("global_scheduler*.py"):
        named |= set(re.findall(r'reason="([a-z_]+)"', path.read_text()))
    assert named and named <= set(REJECT_REASONS), named - set(REJECT_REASONS)


def test_every_finish_reason_a_node_sends_is_one_the_gateway_accepts() -> None:
    """``check_event`` refuses a ``finish_reason`` outside ``FINISH_REASONS`` (a metric label
    and the OpenAI API's value): every finish the engine's code names (``_finish(seq, ...)``,
    ``_stop_reason``'s returns, ``abort_request``'s reasons), but the two a node sends as
    ``error`` events, must be in it; and every tier a node counts cached tokens in in ``TIERS``."""
    from cache_node.tiers.manager import TIERS as NODE_TIERS
    from services.block_index import TIERS

    pattern = r'_finish\(seq, "([a-z_]+)"|reason(?:: str)? ?= ?"([a-z_]+)"|return "([a-z_]+)"'
    named = set()
    for path in [*Path("cache_node").glob("engine*.py"), Path("services/cache_node_streams.py")]:
        named |= {name for match in re.findall(pattern, path.read_text()) for name in match if name}
    assert {"stop", "length", "abort", "error"} <= named
    assert named - {"error", "rejected"} <= set(data_plane.FINISH_REASONS)
    assert set(NODE_TIERS) == set(TIERS)
