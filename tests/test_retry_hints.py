"""Every refusal that passes with time carries a retry hint (``retry-after-ms``, the HTTP API's
``Retry-After``), and one that stands until the client acts carries none (OpenAI API review
20, O2): the scheduler's admissions (plain class), the gateway's own refusals (real
``InferenceServicer`` and ``NodeStreams`` over real ZeroMQ sockets, the stand-ins of
``tests/test_gateway_stream_bounds.py``) and their HTTP response (``HttpCallContext``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
from starlette.requests import Request

from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2
from services.gateway import RETRY_S, InferenceServicer, input_from_pb
from services.gateway_stream_bounds import StreamLimits
from services.global_scheduler import NODE_RETRY_S, GlobalScheduler
from services.node_request import NodeRequest
from services.openai_api.context import CallAborted, HttpCallContext
from tenants.model import Tenant, TenantSpec
from tests.gateway_harness import NODE_INFO
from tests.known_tenants import know_tenants
from tests.test_gateway_stream_bounds import ADMITTED, STARTED, Auth, Plane
from tests.test_gateway_wire_values import Trailing

ANN = Tenant("a1", TenantSpec(name="ann"), 0.0)
PB = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2, 3]),
                                   sampling=inference_pb2.SamplingParams(max_tokens=2))


class NotReading:
    """A node command channel whose inboxes are full (``send`` returns False)."""

    def send(self, _address: str, _message: dict[str, Any]) -> bool:
        return False


def test_the_schedulers_transient_refusals_carry_a_hint_and_too_many_sessions_none(tmp_path) -> None:
    """Regression (oairev20 O2): ``no_healthy_node`` (UNAVAILABLE, 503 over HTTP) had
    ``retry_after_s`` 0, so it went out with no hint; so did ``node_not_reading``. Now they
    carry ``NODE_RETRY_S``; ``too_many_sessions`` deliberately carries none (it stands until a
    session is closed), nor does ``gateway_gone``, which stands while its gateway runs (review
    of 4bf5623, L2: with a hint, clients honouring it retried for ever)."""
    gs = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4}, max_sessions_per_tenant=1), "t1")
    req = NodeRequest(request_id="r0", tenant="t1", cache_namespace="", sampling=SamplingParams(), token_ids=(1, 2))
    gs.attach_nodes({"n0": "tcp://n0:1"}, NotReading())
    not_reading = gs.admit_and_submit(req, "gw", [])
    assert (not_reading.code, not_reading.reason, not_reading.retry_after_s) == (
        "UNAVAILABLE", "node_not_reading", NODE_RETRY_S)
    gs.gateway_gone("gw-old")
    gone = gs.admit_and_submit(req, "gw-old", [])
    assert (gone.code, gone.reason, gone.retry_after_s) == ("UNAVAILABLE", "gateway_gone", 0.0)
    assert gs.admit("t1", "r1", session_id="t1/s1").code == "OK"
    sessions = gs.admit("t1", "r2", session_id="t1/s2")
    assert (sessions.code, sessions.reason, sessions.retry_after_s) == ("RESOURCE_EXHAUSTED", "too_many_sessions", 0.0)
    gs.node_down("n0", "test: marked down")
    down = gs.admit("t1", "r3")
    assert (down.code, down.reason, down.retry_after_s) == ("UNAVAILABLE", "no_healthy_node", NODE_RETRY_S)
    assert NODE_RETRY_S == 1.0


def _servicer(plane: Plane, limits: StreamLimits | None = None) -> InferenceServicer:
    scheduler = SimpleNamespace(release=SimpleNamespace(remote=lambda request_id, usage=None: None))
    auth = Auth()
    servicer = InferenceServicer(scheduler, auth, {"n0": None}, {"n0": {**NODE_INFO, "data_address": plane.node_address}},
                                 None, plane.sched_address, limits=limits)
    plane.streams = servicer.streams
    return servicer


async def _refusal(servicer: InferenceServicer, context: Any, events: int = 0) -> Any:
    """What the call on ``context`` raises after yielding ``events`` events."""
    servicer.auth.tenant_of[id(context)] = ANN
    stream = servicer.generate(context, lambda: input_from_pb(PB))
    try:
        for _ in range(events):
            await asyncio.wait_for(stream.__anext__(), 5)
        await asyncio.wait_for(stream.__anext__(), 5)
    except Exception as exc:  # noqa: BLE001 - the refusal under test
        return exc
    finally:
        await stream.aclose()
    raise AssertionError("the call was not refused")


def test_a_call_past_the_tenants_stream_cap_carries_a_hint_and_its_429_a_retry_after() -> None:
    """Regression (oairev20 O2, /tmp/oairev20/r05_disconnect_429.py): a call past
    ``max_streams_per_tenant`` was refused RESOURCE_EXHAUSTED with no ``retry-after-ms``, so
    its HTTP 429 had no ``Retry-After`` (README promised one on every 429) and the openai
    client spent its retries in ~1.5 s. Now it carries ``RETRY_S`` (1 s) on both APIs."""

    async def run() -> None:
        plane = await Plane().start()
        servicer = _servicer(plane, StreamLimits(max_streams_per_tenant=1))
        await servicer.streams.start()
        servicer.open_streams["a1"] = 1  # the tenant's one call is open
        refused = await _refusal(servicer, context := Trailing())
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_tenant" in str(refused)
        assert context.trailing == (("retry-after-ms", "1000"),) and plane.admitted == []
        http = HttpCallContext(Request({"type": "http", "headers": [], "client": ("10.0.0.1", 5)}))
        aborted = await _refusal(servicer, http)
        assert isinstance(aborted, CallAborted) and aborted.retry_after_ms == 1000
        response = aborted.response()
        assert (response.status_code, response.headers["Retry-After"]) == (429, "1")
        assert RETRY_S == 1.0 and servicer.streams_refused == 2
        plane.close()

    asyncio.run(run())


def test_a_stream_its_node_ends_unavailable_carries_a_hint() -> None:
    """Regression (oairev20 O2, the kind checked whole): a stream its node ended UNAVAILABLE
    (node down or drained: the scheduler routes the retry elsewhere) ended with no hint. Now
    it carries ``RETRY_S``."""

    async def run() -> None:
        plane = await Plane().start({"adm": ADMITTED})
        servicer = _servicer(plane)
        await servicer.streams.start()
        context = Trailing()
        call = asyncio.ensure_future(_refusal(servicer, context, events=1))
        for _ in range(500):
            if plane.admitted:
                break
            await asyncio.sleep(0.01)
        rid = plane.admitted[0]
        down = {"type": "error", "code": "UNAVAILABLE", "message": "cache node n0 failed; retry the request"}
        plane.push.send(servicer.streams.subscriber, [[rid, {**STARTED, "request_id": rid}], [rid, down]])
        refused = await asyncio.wait_for(call, 5)
        assert refused.code == grpc.StatusCode.UNAVAILABLE and "n0 failed" in str(refused)
        assert context.trailing == (("retry-after-ms", "1000"),)
        plane.close()

    asyncio.run(run())


def test_an_admission_the_scheduler_never_answers_carries_a_hint() -> None:
    """Regression (oairev20 O2, the kind checked whole): an admission not answered within
    ``admit_timeout_s`` (the scheduler busy or being restarted) ended UNAVAILABLE with no hint.
    Now it carries ``RETRY_S``; a scheduler fault (a malformed reply, RuntimeError) still
    carries none (``tests/test_gateway_wire_values.py``)."""

    async def run() -> None:
        plane = await Plane().start()
        servicer = _servicer(plane)
        await servicer.streams.start()

        async def silent(_req: Any, _hashes: Any, _key_id: str = "", spec: str = "", siblings: tuple = ()) -> Any:
            raise asyncio.TimeoutError

        servicer.streams.admit = silent  # type: ignore[method-assign]
        refused = await _refusal(servicer, context := Trailing())
        assert refused.code == grpc.StatusCode.UNAVAILABLE and "did not answer" in str(refused)
        assert context.trailing == (("retry-after-ms", "1000"),)
        plane.close()

    asyncio.run(run())
