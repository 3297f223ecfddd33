"""A turn that opens its session (``NodeRequest.opens_session``) never continues a stale session
of the same id still held on its node.

Regression: session ids are the client's, and a turn whose session the scheduler routed nowhere
opened the session on the node it picked. When that node still held an old session of that id
(its close never reached the node: a node that did not report in time after a scheduler
restart, a lost CloseSession; or a session the scheduler forgot while the node kept it), the new
session's first turn was appended to the old history there, and the client got, with OK, an
answer conditioned on a conversation it had closed. Now the scheduler says when a turn opens its
session, and the node closes a stale session of that id first (KV freed, kept messages' budget
given back), aborting its turn still running. The real model, node and data plane.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest
from tests.test_admission_sessions import scheduler
from tests.test_admission_sessions import turn as admitted_turn
from tests.test_cache_node_streams import connect

OLD = "Remember this: the secret word is pineapple. Now count from one to five."
NEW = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def node():
    n = CacheNode("t", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0), num_threads=1)
    yield n
    n.shutdown()


def turn(rid: str, sid: str, text: str, max_tokens: int = 8, namespace: str = "ns", **kw) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace=namespace, session_id=sid,
                       messages=({"role": "user", "content": text},),
                       sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)


def tokens(events: list) -> list[int]:
    return [t for e in events if e["type"] == "delta" for t in e["token_ids"]]


def settle(node: CacheNode, sessions: int) -> None:
    for _ in range(300):
        if node.stats()["sessions"] == sessions and not node.engine.requests:
            return
        time.sleep(0.1)


def close_all(node: CacheNode, *sids: str) -> None:
    async def run() -> None:
        for sid in sids:
            await node.close_session(sid, "t")
    asyncio.run(run())
    settle(node, 0)
    assert node.stats()["sessions"] == 0 and node.stats()["used_blocks"] == 0
    assert not node._session_messages.tenant_chars
    node.engine.check_integrity()


def test_an_opening_turn_drops_the_stale_session_and_answers_as_a_fresh_one(node) -> None:
    """The node holds session t/s (two turns, its messages kept); a turn opening t/s anew
    answers token for token as the same turn opening a fresh session does, and the session then
    holds its tokens alone: the old history's blocks and kept characters are given back. A
    repeated submit of that opening turn is refused ALREADY_EXISTS and leaves the session."""

    async def run():
        gw = await connect(node)
        await gw.submit(turn("o1", "t/s", OLD))
        await gw.drain({"o1"})
        await gw.submit(turn("o2", "t/s", "And then?", continues_session=True))
        await gw.drain({"o2"})
        stale = list(node.engine.sessions.sessions["t/s"].token_ids)
        await gw.submit(turn("ref", "t/ref", NEW, namespace="ns-ref"))
        ref = await gw.drain({"ref"})
        await gw.submit(turn("new1", "t/s", NEW, opens_session=True))
        new = await gw.drain({"new1"})
        settle(node, 2)
        held = list(node.engine.sessions.sessions["t/s"].token_ids)
        await gw.submit(turn("new1", "t/s", NEW, opens_session=True))  # the same submit again
        again = await gw.drain({"new1"})
        return stale, ref, new, held, again

    stale, ref, new, held, again = asyncio.run(run())
    assert new["new1"][-1]["type"] == "finished", new["new1"][-1]
    assert tokens(new["new1"]) == tokens(ref["ref"]) and len(tokens(ref["ref"])) == 8
    assert new["new1"][0]["prompt_tokens"] == ref["ref"][0]["prompt_tokens"] < len(stale)
    assert held == node.engine.sessions.sessions["t/ref"].token_ids  # the old history is gone
    assert held[: len(stale)] != stale
    assert node._session_messages["t/s"] == node._session_messages["t/ref"]
    assert node._session_messages.tenant_chars["t"] == 2 * node._session_messages.chars("t/ref")
    assert node.engine.sessions.sessions["t/s"].opened_by == "new1"
    assert again["new1"][-1]["type"] == "error" and again["new1"][-1]["code"] == "ALREADY_EXISTS"
    assert node.engine.sessions.sessions["t/s"].token_ids == held  # left as it was
    node.engine.check_integrity()
    close_all(node, "t/s", "t/ref")


def test_an_opening_turn_aborts_the_stale_sessions_running_turn(node) -> None:
    """A turn of the stale session still runs (its scheduler forgot the session): it ends
    ABORTED naming why, its blocks are freed, and the opening turn answers as a fresh session's
    first turn."""

    async def run():
        gw = await connect(node)
        await gw.submit(turn("s1", "t/s", OLD))
        await gw.drain({"s1"})
        await gw.submit(turn("ref", "t/ref", NEW, namespace="ns-ref"))
        ref = await gw.drain({"ref"})
        await gw.submit(turn("s2", "t/s", "Keep counting to two hundred.", max_tokens=400, continues_session=True))
        got: dict[str, list] = {}
        deadline = time.monotonic() + 60
        while sum(e["type"] == "delta" for e in got.get("s2", [])) < 2:  # it runs
            assert time.monotonic() < deadline, got
            for rid, event in await gw.poll(0.5):
                got.setdefault(rid, []).append(event)
        await gw.submit(turn("new1", "t/s", NEW, opens_session=True))
        rest = await gw.drain({"s2", "new1"})
        return ref, got["s2"] + rest.get("s2", []), rest["new1"]

    ref, old, new = asyncio.run(run())
    assert old[-1]["type"] == "error" and old[-1]["code"] == "ABORTED", old[-1]
    assert "opened this session anew" in old[-1]["message"]
    assert len(tokens(old)) < 400
    assert new[-1]["type"] == "finished" and tokens(new) == tokens(ref["ref"])
    settle(node, 2)
    assert node.engine.sessions.sessions["t/s"].token_ids == node.engine.sessions.sessions["t/ref"].token_ids
    node.engine.check_integrity()
    close_all(node, "t/s", "t/ref")


def test_opens_session_is_bounded_on_the_wire() -> None:
    """The data plane carries the flag, and refuses one no scheduler sends: an opening turn
    without a session, or one that says it both opens and continues its session."""
    req = turn("r", "t/s", NEW, opens_session=True)
    assert data_plane.request_from_wire(data_plane.request_to_wire(req)).opens_session is True
    for bad in ({"session_id": ""}, {"continues_session": True}):
        wire = {**data_plane.request_to_wire(req), **bad}
        with pytest.raises(ValueError, match="opens_session"):
            data_plane.request_from_wire(wire)
    with pytest.raises(TypeError, match="opens_session"):
        data_plane.request_from_wire({**data_plane.request_to_wire(req), "opens_session": 1})


def test_the_scheduler_says_a_turn_opens_its_session_only_when_it_made_the_route(tmp_path) -> None:
    """``opens_session`` is the scheduler's to set, whatever the gateway sent: True for the turn
    whose admission made its session's route (a new id, and one closed since), False for a turn
    routed to its session's node and for a session-less request."""
    gs, ids = scheduler(tmp_path, "fcfs")
    tenant = ids["chat"]

    def sent(req: NodeRequest) -> dict:
        assert gs.admit_and_submit(req, "gw", []).code == "OK"
        return gs.commands.sent[-1][1]["req"]

    def forged(rid: str, session: str, **kw) -> NodeRequest:
        import dataclasses
        return dataclasses.replace(admitted_turn(tenant, rid, session, None), **kw)

    first = sent(forged("r1", "s1", opens_session=False))
    assert (first["opens_session"], first["continues_session"]) == (True, False)
    beside = sent(forged("r2", "s1", opens_session=True))  # a gateway's flag does not stand
    assert (beside["opens_session"], beside["continues_session"]) == (False, False)
    gs.release("r1", {"prefill_tokens_per_s": 100.0, "finish_reason": "length", "prompt_tokens": 3,
                      "completion_tokens": 1})
    gs.release("r2", {"prefill_tokens_per_s": 100.0, "finish_reason": "length", "prompt_tokens": 3,
                      "completion_tokens": 1})
    later = sent(forged("r3", "s1", opens_session=True))
    assert (later["opens_session"], later["continues_session"]) == (False, True)
    gs.release("r3", None)
    assert gs.close_session("s1", tenant) is not None
    reopened = sent(forged("r4", "s1"))
    assert (reopened["opens_session"], reopened["continues_session"]) == (True, False)
    plain = sent(forged("r5", "", opens_session=True, continues_session=True))
    assert (plain["opens_session"], plain["continues_session"]) == (False, False)


def test_a_stale_sessions_expiry_leaves_the_route_its_new_session_just_opened(tmp_path) -> None:
    """The node expires the stale session of an id just as a turn opening that id anew is in
    flight to it: the expiry is the stale session's, so the new route stays (regression: it was
    dropped, and the new session's next turn opened it anew elsewhere, without its history).
    Once that turn has ended, the node's expiry of the id is the new session's and drops it."""
    gs, ids = scheduler(tmp_path, "fcfs")
    tenant = ids["chat"]
    assert gs.admit_and_submit(admitted_turn(tenant, "r1", "s1", None), "gw", []).code == "OK"
    gs.sessions_ended("n0", ["s1"])
    assert gs.session_nodes["s1"] == (tenant, "n0")
    gs.release("r1", {"prefill_tokens_per_s": 100.0, "finish_reason": "length", "prompt_tokens": 3,
                      "completion_tokens": 1})
    gs.sessions_ended("n0", ["s1"])
    assert "s1" not in gs.session_nodes
