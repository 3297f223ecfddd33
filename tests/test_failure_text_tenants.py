"""A node's or the scheduler's internal failure text never reaches a tenant (review s35 C, S1).

The fault: a cache node's step-loop exception text (``cache node X: step loop failed:
<Type>: <text>``) went verbatim to every tenant: as the UNAVAILABLE message of every stream
open on the node (``Health._fail``, and the gateway's ``NodeStreams.fail_node`` /``bind`` with
the node's health failure), and in later admission refusals (``no cache node is healthy:
<reasons>``, ``session_node_down``'s message); an exception in the scheduler's admission went to
the tenant as its UNAVAILABLE message. Such a text may name another tenant's request or session
id. Now tenants get the node's id and an error id; the text stays with operators (the log,
``failure`` in health and Stats, the scheduler's and gateway's ``down``).

Real ``Health`` and ``Streams`` of a cache node over real ZeroMQ to a real gateway inbox
(``NodeStreams``), and a real ``GlobalSchedulerService``.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from services import data_plane
from services.gateway_streams import NodeStreams
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.model import TenantSpec
from tests.test_data_plane_limits import _Node

SECRET = "KeyError: 'bob0123/session-of-bob'"
"""An exception text naming another tenant's scoped session id."""


def test_a_failed_step_loops_text_goes_to_operators_not_tenants() -> None:
    """``_fail`` with a text naming bob's session: alice's open streams end UNAVAILABLE naming
    the node and an error id only; the node's ``failure`` (health, Stats) has the id and the
    text. The gateway's own verdict on the node (``fail_node`` with that failure) and a stream
    bound to the node afterwards say only that the node is down; ``down`` keeps the reason."""

    async def run() -> None:
        streams = NodeStreams({}, {}, "tcp://127.0.0.1:1", security=None)
        await streams.start()
        node = _Node()
        try:
            buffer = streams.open("alice01/r#1")
            node.open_stream("alice01/r#1", streams.subscriber)
            node._fail(f"cache node cache_node_0: step loop failed: {SECRET}")
            event = await asyncio.wait_for(buffer.get(), 30)
            assert event["code"] == "UNAVAILABLE" and "bob" not in event["message"], event
            error_id = re.search(r"error id ([0-9a-f]{12})", event["message"])
            assert error_id is not None and event["message"].startswith("cache node cache_node_0"), event
            assert error_id.group(1) in node.failure and SECRET in node.failure

            later = streams.open("alice01/r#2")
            streams.fail_node("cache_node_0", node.failure)
            streams.bind("alice01/r#2", "cache_node_0")
            event = await asyncio.wait_for(later.get(), 30)
            assert event["code"] == "UNAVAILABLE" and "bob" not in event["message"], event
            assert streams.down["cache_node_0"] == node.failure
        finally:
            node._pusher.close()
            streams.shutdown()

    asyncio.run(run())


def test_admission_refusals_and_failures_keep_internal_text_from_tenants(tmp_path: Path) -> None:
    """Every node down with a reason naming bob's session: alice's admission is refused
    ``no_healthy_node`` and her session's turn ``session_node_down`` without that reason
    (``down`` keeps it); an exception inside the scheduler's admission is answered with an
    error id, not its text."""
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1, "n1": 1})
    try:
        alice, _ = sched.store.register(TenantSpec("alice"))
        sched.specs[alice.tenant_id] = alice.spec
        tid = alice.tenant_id
        sched.route_unconfirmed(tid, f"{tid}/s", "n0")
        sched.node_down("n0", f"cache node n0: step loop failed: {SECRET}")
        adm = sched.admit(tid, f"{tid}/r1", session_id=f"{tid}/s")
        assert adm.reason == "session_node_down" and "bob" not in adm.message, adm
        sched.node_down("n1", f"cache node n1: step loop failed: {SECRET}")
        adm = sched.admit(tid, f"{tid}/r2")
        assert adm.reason == "no_healthy_node" and "bob" not in adm.message, adm
        assert SECRET in sched.down["n0"]

        def broken(*args: object) -> None:
            raise KeyError("bob0123/session-of-bob")

        sched.admit_and_submit = broken  # type: ignore[method-assign]  # a fault inside admission
        from cache_node.sampling_params import SamplingParams
        from services.node_request import NodeRequest

        req = data_plane.request_to_wire(NodeRequest(request_id=f"{tid}/r3", tenant=tid, cache_namespace="",
                                                     sampling=SamplingParams(), token_ids=(1, 2)))
        reply = sched._answer(data_plane.pack({"id": 7, "req": req, "sub": "tcp://127.0.0.1:1", "hashes": []}))
        assert reply is not None and reply["id"] == 7 and "bob" not in reply["error"], reply
        assert re.search(r"error id [0-9a-f]{12}", reply["error"]), reply
    finally:
        sched.store.close()
