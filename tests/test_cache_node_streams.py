"""The plain CacheNode's two delivery paths, with the real model and no Ray.

The data plane is what the gateway uses: ``submit``/``abort`` commands on the node's ZeroMQ
command inbox, and one message per step with every event for a gateway on that gateway's event
inbox. These tests drive it over real sockets, as the scheduler and gateway do, and check that
it carries the same events as ``generate``, posts refusals like any other event, and that
``abort`` frees the request's blocks.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
import zmq

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest

PROMPT = (1, 504, 3575, 28, 614, 1242, 314, 216, 1241, 2406, 30, 2)


@pytest.fixture(scope="module")
def node():
    n = CacheNode("t", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0), num_threads=1)
    yield n
    n.shutdown()


def request(rid: str, max_tokens: int = 6, tokens: tuple[int, ...] = PROMPT, tenant: str = "t", **kw) -> NodeRequest:
    return NodeRequest(
        request_id=rid, tenant=tenant, cache_namespace="ns", token_ids=tokens,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw,
    )


class Gateway:
    """A gateway's end of the data plane: an event inbox and a socket to the node's inbox."""

    def __init__(self, node_address: str) -> None:
        ctx = data_plane.context(asyncio_=True)
        self.inbox = ctx.socket(zmq.PULL)
        self.subscriber = data_plane.bind_random(self.inbox, "127.0.0.1")
        self.commands = ctx.socket(zmq.PUSH)
        self.commands.connect(node_address)

    async def submit(self, req: NodeRequest) -> None:
        await self.commands.send(data_plane.pack(
            {"op": "submit", "req": data_plane.request_to_wire(req), "sub": self.subscriber}))

    async def abort(self, request_id: str) -> None:
        await self.commands.send(data_plane.pack({"op": "abort", "id": request_id}))

    async def poll(self, timeout_s: float) -> list:
        """Every event message that arrives within ``timeout_s``, flattened."""
        if not await self.inbox.poll(timeout_s * 1000):
            return []
        items = data_plane.unpack(await self.inbox.recv())
        while await self.inbox.poll(0):
            items += data_plane.unpack(await self.inbox.recv())
        return items

    async def drain(self, want: set[str], timeout_s: float = 60.0) -> dict[str, list]:
        """Events per request, in order, until every request in ``want`` has its last one."""
        got: dict[str, list] = {}
        deadline = time.monotonic() + timeout_s
        while want - {r for r, evs in got.items() if evs and evs[-1]["type"] in ("finished", "error")}:
            assert time.monotonic() < deadline, got
            for rid, event in await self.poll(0.5):
                got.setdefault(rid, []).append(event)
        return got


async def connect(node: CacheNode) -> Gateway:
    return Gateway(await node.open_data_plane())


def test_request_wire_format_round_trips() -> None:
    req = request("w", messages=({"role": "user", "content": "hi"},), session_id="s", prefetch=True,
                  extra={"slo_class": "interactive"})
    assert data_plane.request_from_wire(data_plane.unpack(data_plane.pack(data_plane.request_to_wire(req)))) == req
    with pytest.raises(ValueError, match="max_tokens"):
        data_plane.request_from_wire({**data_plane.request_to_wire(req), "sampling": {"max_tokens": 0}})
    # review 28a F3: a namespace was bounded only by msgpack's 4 MiB string limit; it reaches the
    # spill tier's file headers (16 KiB at most), where a long one failed another tenant's put
    long = {**data_plane.request_to_wire(req), "cache_namespace": "n" * 2049}
    with pytest.raises(ValueError, match="cache_namespace must have at most 2048 characters"):
        data_plane.request_from_wire(long)
    assert data_plane.request_from_wire({**long, "cache_namespace": "n" * 2048}).cache_namespace == "n" * 2048


def test_the_data_plane_carries_the_same_tokens_as_generate(node) -> None:
    async def run():
        direct = [ev async for ev in node.generate(request("g"))]
        gw = await connect(node)
        await gw.submit(request("a"))
        await gw.submit(request("b", max_tokens=3))
        return direct, await gw.drain({"a", "b"})

    direct, polled = asyncio.run(run())
    tokens = [t for ev in direct if ev["type"] == "delta" for t in ev["token_ids"]]
    for rid, n in (("a", 6), ("b", 3)):
        kinds = [ev["type"] for ev in polled[rid]]
        assert kinds[0] == "started" and kinds[-1] == "finished" and set(kinds[1:-1]) == {"delta"}
        got = [t for ev in polled[rid] if ev["type"] == "delta" for t in ev["token_ids"]]
        assert got == tokens[:n]  # greedy: the same continuation through either path
        assert polled[rid][-1]["completion_tokens"] == n


def test_a_refused_request_gets_its_error_as_an_event(node) -> None:
    async def run():
        gw = await connect(node)
        await gw.submit(request("empty", tokens=()))
        await gw.submit(request("fine", max_tokens=2))
        return await gw.drain({"empty", "fine"})

    got = asyncio.run(run())
    assert [ev["type"] for ev in got["empty"]] == ["error"]
    assert got["empty"][0]["code"] == "INVALID_ARGUMENT"
    assert got["fine"][-1]["type"] == "finished"


def test_a_request_past_its_context_and_the_smaller_pool_is_told_the_pool(node) -> None:
    """Review 25b R2: a request (a session turn with its history, which only the node sees)
    past both its context limit and the node's smaller pool, under a policy that keeps every
    token, was told the context limit, then, trimmed to it, the pool. Now the pool, its bound;
    under a compressing policy, which may outgrow the pool, the context limit."""
    pool = node.engine.scheduler.pool_tokens
    assert pool + 100 < node.engine.max_model_len
    over = pool + 100 - len(PROMPT) + 1  # prompt + max_tokens: one past the context limit

    async def run():
        gw = await connect(node)
        await gw.submit(request("full", max_tokens=over, max_context_tokens=pool + 100))
        await gw.submit(request("snap", max_tokens=over, max_context_tokens=pool + 100, policy="snapkv-0.5"))
        return await gw.drain({"full", "snap"})

    got = asyncio.run(run())
    assert got["full"] == [{"type": "error", "code": "INVALID_ARGUMENT", "message":
                            f"prompt ({len(PROMPT)} tokens) + max_tokens ({over}) needs {pool + 101} tokens of KV "
                            f"at once; this node's KV pool holds {pool} tokens"}]
    assert got["snap"] == [{"type": "error", "code": "INVALID_ARGUMENT", "message":
                            f"prompt ({len(PROMPT)}) + max_tokens ({over}) exceeds the tenant's "
                            f"max_context_tokens ({pool + 100})"}]
    node.engine.check_integrity()


def test_an_unexpected_fault_in_starting_a_request_fails_it_alone(node, monkeypatch) -> None:
    """Regression class: an exception of a kind ``_start_incoming`` did not expect (e.g. an
    OverflowError from a policy value) escaped into the step loop, which failed the node and
    every tenant's requests on it. Now that request gets INTERNAL; the others run."""
    add = node.engine.add_request

    def faulty(prompt, *args, **kw):  # type: ignore[no-untyped-def]
        if kw.get("request_id") == "bad":
            raise OverflowError("cannot convert float infinity to integer")
        return add(prompt, *args, **kw)

    monkeypatch.setattr(node.engine, "add_request", faulty)

    async def run():
        gw = await connect(node)
        await gw.submit(request("bad"))
        await gw.submit(request("fine2", max_tokens=2))
        return await gw.drain({"bad", "fine2"})

    got = asyncio.run(run())
    assert [ev["type"] for ev in got["bad"]] == ["error"] and got["bad"][0]["code"] == "INTERNAL"
    assert "error id" in got["bad"][0]["message"] and got["fine2"][-1]["type"] == "finished"
    assert "OverflowError" not in got["bad"][0]["message"]  # the text stays in the node's log
    assert node.engine.stats()["used_blocks"] == 0


def test_abort_stops_events_and_frees_blocks(node) -> None:
    async def run():
        gw = await connect(node)
        await gw.submit(request("long", max_tokens=400))
        first = await gw.poll(30.0)  # the first step's events
        assert first and first[0][0] == "long"
        await gw.abort("long")
        # the abort lands at the next step boundary (30 s: a loaded machine). Taken there, not
        # from ``stats()``: that snapshot may predate the request (regression: the loop ended
        # on a snapshot from before its first step, and the check after it found its block)
        for _ in range(300):
            fresh = await node.integrity_stats()
            if fresh["used_blocks"] == 0 and fresh["running"] == 0:
                break
            await asyncio.sleep(0.1)
        await gw.poll(0.1)  # whatever the last step posted before the abort
        return await gw.poll(0.3), await node.integrity_stats()

    late, fresh = asyncio.run(run())
    assert late == []  # nothing more for the aborted request
    assert "long" not in node._streams
    assert fresh["used_blocks"] == 0 and fresh["running"] == 0 and fresh["integrity_ok"]


def test_a_repeated_submit_leaves_the_running_request_alone(node) -> None:
    """Review 25a F: the same submit again (ids are per attempt: no sound scheduler repeats
    one) was answered ALREADY_EXISTS under the running request's own id, so its gateway ended
    that request's call and released it while the node ran it on, unseen and unbilled. Now
    the repeat is dropped and counted, and the request's stream carries on to its end; a
    submit of that id from another gateway is still refused there alone."""
    bad_before = node.bad_messages

    async def run():
        address = await node.open_data_plane()
        gw, other = Gateway(address), Gateway(address)  # two gateways' event inboxes
        await gw.submit(request("dup", max_tokens=24))
        first: list = []
        while not first:  # its first step's events
            first = await asyncio.wait_for(gw.poll(60.0), 120.0)
        assert first[0][0] == "dup" and first[-1][1]["type"] != "finished"
        await gw.submit(request("dup", max_tokens=24))  # the same message again
        await other.submit(request("dup", max_tokens=2))  # another gateway's, same id
        return first, await gw.drain({"dup"}), await other.drain({"dup"})

    first, got, elsewhere = asyncio.run(run())
    events = [ev for _, ev in first] + got["dup"]
    assert [ev["type"] for ev in events if ev["type"] not in ("started", "delta")] == ["finished"]
    assert events[-1]["completion_tokens"] == 24
    assert [(ev["type"], ev.get("code")) for ev in elsewhere["dup"]] == [("error", "ALREADY_EXISTS")]
    assert node.bad_messages == bad_before + 1


def test_an_abort_that_overtakes_its_request_cancels_it(node) -> None:
    """The gateway aborts while the scheduler is still forwarding the request."""
    assert not node.abort("early")

    async def run():
        gw = await connect(node)
        await gw.submit(request("early"))
        return await gw.drain({"early"})

    got = asyncio.run(run())
    assert [(ev["type"], ev.get("code")) for ev in got["early"]] == [("error", "CANCELLED")]
    # stats() is the last step boundary's snapshot (refreshed at most every STATS_EVERY_S): on a
    # loaded machine it still said running 1 here with the scheduler empty; integrity_stats is
    # taken at the next step boundary
    fresh = asyncio.run(node.integrity_stats())
    assert "early" not in node._streams and fresh["running"] == 0 and fresh["integrity_ok"]


def test_a_deleted_tenants_requests_end_and_its_sessions_close(node) -> None:
    """A fresh-user trial: `kvstrata tenant rm bob` left bob's running request generating to
    its end and his session holding 28 blocks until its TTL, with no key left to close it. The
    scheduler's ``end_tenant`` command ends them: ABORTED for the stream, sessions closed,
    blocks freed; another tenant's request runs on."""
    async def run():
        gw = await connect(node)
        await gw.submit(request("bob-turn", max_tokens=4, tenant="bob", session_id="bob/s"))
        done = await gw.drain({"bob-turn"})
        assert "bob/s" in node.engine.sessions.sessions
        await gw.submit(request("bob-long", max_tokens=400, tenant="bob"))
        await gw.submit(request("ann-long", max_tokens=12, tenant="ann"))
        assert await gw.poll(30.0)  # both started
        await gw.commands.send(data_plane.pack({"op": "end_tenant", "tenant": "bob"}))
        return done, await gw.drain({"bob-long", "ann-long"})

    _, got = asyncio.run(run())
    assert got["bob-long"][-1] == {"type": "error", "code": "ABORTED", "message": "the tenant was deleted"}
    assert got["ann-long"][-1]["type"] == "finished" and got["ann-long"][-1]["completion_tokens"] == 12
    for _ in range(50):
        if "bob/s" not in node.engine.sessions.sessions and node.stats()["used_blocks"] == 0:
            break
        time.sleep(0.1)
    assert "bob/s" not in node.engine.sessions.sessions and node.stats()["used_blocks"] == 0
    node.engine.check_integrity()


def test_closing_a_session_during_its_turn_ends_the_turn(node) -> None:
    """A fresh-user trial: `kvstrata close-session` while a turn ran printed "0 tokens freed",
    the turn ran on to its end, and its blocks stayed held until then. Now the turn ends with
    ABORTED, the session is gone and every block is free."""
    async def run():
        gw = await connect(node)
        await gw.submit(request("t1", max_tokens=3, tenant="cat", session_id="cat/s"))
        await gw.drain({"t1"})
        history = node.engine.session_history("cat/s")
        await gw.submit(request("t2", max_tokens=400, tenant="cat", session_id="cat/s"))  # + history
        assert await gw.poll(30.0)  # started
        assert await node.close_session("cat/s", "dog") == -1  # not dog's to close
        freed = await node.close_session("cat/s", "cat")
        return history, freed, await gw.drain({"t2"})

    history, freed, got = asyncio.run(run())
    assert freed >= len(history) + len(PROMPT)
    assert got["t2"][-1] == {"type": "error", "code": "ABORTED", "message": "the session was closed"}
    for _ in range(300):
        if node.stats()["used_blocks"] == 0 and node.stats()["sessions"] == 0:
            break
        time.sleep(0.1)
    assert "cat/s" not in node.engine.sessions.sessions and node.stats()["used_blocks"] == 0
    node.engine.check_integrity()


def test_a_turn_overtaken_by_its_sessions_close_is_aborted_never_run_without_history(node) -> None:
    """A hardening review: a turn that reached the node but had not started when a
    CloseSession of its session ran there was computed from its new tokens alone (its answer
    silently ignored the conversation) and opened the closed session again, holding KV until
    its TTL; a first turn so overtaken opened the session the close had answered NOT_FOUND
    for. Now a turn the scheduler routed to its session's node (``continues_session``) that
    finds no session there is ABORTED, and a close ends the session's turns not yet started."""
    import threading

    async def run():
        gw = await connect(node)
        await gw.submit(request("h1", max_tokens=3, tenant="eel", session_id="eel/s"))
        await gw.drain({"h1"})
        assert await node.close_session("eel/s", "eel") > 0
        await gw.submit(request("h2", max_tokens=3, tenant="eel", session_id="eel/s", continues_session=True))
        gone = await gw.drain({"h2"})
        # a first turn reaches the node while the step thread is held; the close runs first
        held, release = threading.Event(), threading.Event()
        hold = node._between_steps(lambda: (held.set(), release.wait(30)))
        await asyncio.to_thread(held.wait, 30)
        await gw.submit(request("f1", max_tokens=3, tenant="eel", session_id="eel/f"))
        for _ in range(300):
            if any(s.request.request_id == "f1" for s in list(node._incoming)):
                break
            await asyncio.sleep(0.01)
        close = asyncio.ensure_future(node.close_session("eel/f", "eel"))
        while not node._admin:  # queued behind the hold
            await asyncio.sleep(0.01)
        release.set()
        await hold
        return gone, await close, await gw.drain({"f1"})

    gone, closed, first = asyncio.run(run())
    assert gone["h2"][-1]["type"] == "error" and gone["h2"][-1]["code"] == "ABORTED"
    assert "history is gone" in gone["h2"][-1]["message"]
    assert closed == 0  # closed (0 tokens held), not NOT_FOUND
    assert first["f1"][-1] == {"type": "error", "code": "ABORTED", "message": "the session was closed"}
    for _ in range(100):
        if node.stats()["sessions"] == 0 and node.stats()["used_blocks"] == 0:
            break
        time.sleep(0.1)
    assert not {"eel/s", "eel/f"} & set(node.engine.sessions.sessions)
    assert node.stats()["used_blocks"] == 0
    node.engine.check_integrity()


def test_a_turn_reaching_its_session_while_a_turn_runs_is_aborted_naming_the_clients_id(node) -> None:
    """Review 25b R1: a second turn reaching a session while its turn ran was refused
    INVALID_ARGUMENT (HTTP 400 ``invalid_argument``, as for a malformed request) naming the
    tenant-scoped id ``'<tenant>/<session>'``. Now it is ABORTED (HTTP 409, a transient
    conflict) naming the client's id; the running turn goes on, the refused one takes nothing,
    and the same turn sent after the running one ends runs from the session's history."""
    async def run():
        gw = await connect(node)
        # 32 tokens are 32 steps (seconds here); the second turn arrives within milliseconds
        await gw.submit(request("b1", max_tokens=32, tenant="cow", session_id="cow/busy-1"))
        assert await gw.poll(30.0)  # started
        await gw.submit(request("b2", max_tokens=3, tenant="cow", session_id="cow/busy-1"))
        refused = await gw.drain({"b2"})
        first = await gw.drain({"b1"})
        history = node.engine.session_history("cow/busy-1")
        await gw.submit(request("b2", max_tokens=3, tenant="cow", session_id="cow/busy-1"))
        return refused, first, history, await gw.drain({"b2"})

    refused, first, history, again = asyncio.run(run())
    assert refused["b2"] == [{"type": "error", "code": "ABORTED", "message":
                              "session 'busy-1' already has a turn running: one turn at a time per session; "
                              "send this turn again after that one ends"}]
    assert first["b1"][-1]["type"] == "finished" and first["b1"][-1]["completion_tokens"] == 32
    assert again["b2"][-1]["type"] == "finished"
    assert again["b2"][-1]["prompt_tokens"] == len(history) + len(PROMPT)
    assert asyncio.run(node.close_session("cow/busy-1", "cow")) > 0
    for _ in range(100):
        if node.stats()["used_blocks"] == 0:
            break
        time.sleep(0.1)
    assert node.stats()["used_blocks"] == 0
    node.engine.check_integrity()


def test_a_policy_fault_in_a_step_fails_that_request_alone(node, monkeypatch) -> None:
    """Regression: a KV policy's exception inside the step stopped the node's step loop and
    failed every tenant's requests on it. Now that request gets INTERNAL and the request in
    the same batch finishes with its tokens (``LLMEngine._recover``)."""
    from cache_node.kv_state import SequenceKV

    attend = SequenceKV.attend

    def faulty(self, *args, **kw):  # type: ignore[no-untyped-def]
        if self.seq.request_id == "policy-bad":
            raise IndexError("index 40 is out of bounds for dimension 0 with size 40")
        return attend(self, *args, **kw)

    monkeypatch.setattr(SequenceKV, "attend", faulty)

    async def run():
        direct = [ev async for ev in node.generate(request("solo", policy="h2o-8"))]
        gw = await connect(node)
        await gw.submit(request("policy-bad", policy="h2o-8"))
        await gw.submit(request("policy-fine", policy="h2o-8"))
        return direct, await gw.drain({"policy-bad", "policy-fine"})

    direct, got = asyncio.run(run())
    assert got["policy-bad"][-1]["type"] == "error" and got["policy-bad"][-1]["code"] == "INTERNAL"
    assert got["policy-fine"][-1]["type"] == "finished"
    tokens = [t for ev in got["policy-fine"] if ev["type"] == "delta" for t in ev["token_ids"]]
    assert tokens == [t for ev in direct if ev["type"] == "delta" for t in ev["token_ids"]]
    assert node.engine.stats()["used_blocks"] == 0 and node.engine.num_failed_requests == 1


def test_a_malformed_submit_gets_its_error_event(node) -> None:
    """A submit whose request fails the node's checks was dropped and counted, and nothing
    told its gateway, which waited for events forever. Its gateway now gets INVALID_ARGUMENT
    for that id (when the id itself is readable)."""
    async def run():
        gw = await connect(node)
        wire = data_plane.request_to_wire(request("typo"))
        await gw.commands.send(data_plane.pack({"op": "submit", "sub": gw.subscriber,
                                                "req": {**wire, "sampling": {"max_tokens": "6"}}}))
        return await gw.drain({"typo"})

    bad = node.bad_messages
    got = asyncio.run(run())
    assert got["typo"][-1]["type"] == "error" and got["typo"][-1]["code"] == "INVALID_ARGUMENT"
    assert "max_tokens" in got["typo"][-1]["message"] and node.bad_messages == bad + 1


def test_tpot_is_measured_on_the_nodes_own_clock(node) -> None:
    """Security review: ``tpot_ms`` subtracted the gateway's ``arrival_time_s`` (its monotonic
    clock) from the node's, so on two machines it was silently wrong. A gateway clock far
    from the node's no longer shows in it."""
    async def run():
        far = request("clock", max_tokens=4, arrival_time_s=1.0)  # another machine's clock
        return [ev async for ev in node.generate(far)]

    finished = asyncio.run(run())[-1]
    assert finished["type"] == "finished" and 0.0 < finished["tpot_ms"] < 10_000.0


def test_chat_turns_render_off_the_step_thread_as_the_step_thread_would(node, monkeypatch) -> None:
    """Regression (diff review): a session turn's messages were rendered and tokenized on the
    step thread (a 640K-character turn that fits stopped every stream for ~1 s). Now the
    node's renderer thread makes the prompt ahead, in its render child (review s35 E F3: not
    in the node's process, ``services.render_process``); the step thread uses it only if the
    session is as it was then, and makes it again otherwise."""
    from services.cache_node_streams import _Stream
    from services.render_process import RenderProcess

    def turn(rid: str, text: str) -> NodeRequest:
        return request(rid, max_tokens=3, tokens=(), tenant="chat", session_id="chat/s",
                       messages=({"role": "user", "content": text},))

    async def run(req: NodeRequest) -> list[dict]:
        return [e async for e in node.generate(req)]

    assert asyncio.run(run(turn("c1", "Name a colour.")))[-1]["type"] == "finished"
    history = node.engine.session_history("chat/s")
    second = turn("c2", "And another one?")
    expected = node._prompt(second, history)  # what the step thread would make

    threads: list[str] = []  # the threads asking the render child
    for name in ("first_turn", "continue_session"):
        real = getattr(RenderProcess, name)

        def spy(*a, _real=real, **kw):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            return _real(*a, **kw)

        def here(*a, **kw):  # type: ignore[no-untyped-def]
            raise AssertionError("rendered in the node's process")

        monkeypatch.setattr(RenderProcess, name, spy)
        monkeypatch.setattr(node.templater, name, here)
    assert len(expected) > len(history)
    got = asyncio.run(run(second))
    assert got[-1]["type"] == "finished" and got[-1]["prompt_tokens"] == len(expected)
    assert threads and all(t.startswith("kvstrata-render") for t in threads), threads

    # rendered ahead for a session that changed since: queued to be rendered again, off the
    # step thread (review 28a F4: the step thread rendered it again itself)
    now = node.engine.session_history("chat/s")
    stale = _Stream(None, None, turn("c3", "A third?"), 0)
    stale.rendered = (history, 2, [1, 2, 3])
    threads.clear()
    assert node._prompt_of(stale) is None and stale.rendered is None
    deadline = time.monotonic() + 10
    while stale in node._rendering and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stale not in node._rendering and not threads  # (not a stream the node holds: not rendered)
    fresh = _Stream(None, None, turn("c4", "A fourth?"), 0)
    fresh.rendered = (now, len(node._session_messages["chat/s"]), [4, 5, 6])
    assert node._prompt_of(fresh) == [4, 5, 6]
    asyncio.run(node.close_session("chat/s", "chat"))


def test_the_schedulers_close_of_a_session_closes_that_tenants_session_alone(node) -> None:
    """The scheduler's ``close_session`` command (a session closed while its node was taken
    for down): the tenant's own session closes and frees its KV; another tenant's equal id
    is not touched."""
    async def run() -> None:
        gw = await connect(node)
        for rid, tenant in (("cs-1", "ann"), ("cs-2", "bob")):
            await gw.submit(request(rid, max_tokens=2, tenant=tenant, session_id=f"{tenant}/s"))
        await gw.drain({"cs-1", "cs-2"})
        await gw.commands.send(data_plane.pack({"op": "close_session", "session": "ann/s", "tenant": "bob"}))
        await gw.commands.send(data_plane.pack({"op": "close_session", "session": "bob/s", "tenant": "bob"}))
        for _ in range(100):
            if "bob/s" not in node.engine.sessions.sessions:
                break
            await asyncio.sleep(0.05)

    asyncio.run(run())
    assert "bob/s" not in node.engine.sessions.sessions and "ann/s" in node.engine.sessions.sessions
    assert asyncio.run(node.close_session("ann/s", "ann")) > 0


def test_a_turn_its_sessions_close_named_is_refused_when_it_arrives_after_the_close(node) -> None:
    """Regression: a session's first turn still on the data plane when its session's close
    reached the node opened the session after the close, with no route to it (held until its
    TTL), and the close answered NOT_FOUND. Now the close names the session's turns in flight
    (the gateway's call, or the scheduler's ``close_session`` command for a node that was
    taken for down): each arriving after it is refused ABORTED, and the close answers 0. A
    turn the close did not name (sent after it) opens the session; another tenant's turn
    runs to its end."""
    async def run():
        gw = await connect(node)
        await gw.submit(request("fox-long", max_tokens=12, tenant="fox"))
        assert await node.close_session("gnu/s", "gnu", ["gnu-1"]) == 0  # closed, not NOT_FOUND
        await gw.commands.send(data_plane.pack(
            {"op": "close_session", "session": "gnu/t", "tenant": "gnu", "turns": ["gnu-2"]}))
        await gw.commands.send(data_plane.pack(
            {"op": "close_session", "session": "gnu/t", "tenant": "gnu", "turns": "gnu-2"}))  # malformed
        for rid, sid in (("gnu-1", "gnu/s"), ("gnu-2", "gnu/t"), ("gnu-3", "gnu/s")):  # gnu-3: after the close
            await gw.submit(request(rid, max_tokens=3, tenant="gnu", session_id=sid))
        return await gw.drain({"fox-long", "gnu-1", "gnu-2", "gnu-3"})

    bad = node.bad_messages
    got = asyncio.run(run())
    for rid in ("gnu-1", "gnu-2"):
        assert got[rid] == [{"type": "error", "code": "ABORTED", "message": "the session was closed"}]
    assert got["gnu-3"][-1]["type"] == "finished" and node.bad_messages == bad + 1
    assert got["fox-long"][-1]["type"] == "finished" and got["fox-long"][-1]["completion_tokens"] == 12
    assert "gnu/t" not in node.engine.sessions.sessions and "gnu/s" in node.engine.sessions.sessions
    assert asyncio.run(node.close_session("gnu/s", "gnu")) > 0
    fresh = asyncio.run(node.integrity_stats())
    assert fresh["used_blocks"] == 0 and fresh["sessions"] == 0 and fresh["integrity_ok"]


def _chat_turn(rid: str, text: str, tenant: str, session_id: str) -> NodeRequest:
    return request(rid, max_tokens=3, tokens=(), tenant=tenant, session_id=session_id,
                   messages=({"role": "user", "content": text},))


def _events(node: CacheNode, req: NodeRequest) -> list[dict]:
    async def run() -> list[dict]:
        return [e async for e in node.generate(req)]

    return asyncio.run(run())


def test_a_session_turn_of_characters_the_tokenizer_drops_is_refused_and_the_session_goes_on(node) -> None:
    """Regression (security review F3): a turn of characters the tokenizer drops (U+0004)
    finished, added a few tokens to the history and all its text to what the node keeps for
    the session (~112 MB per session over ~340 turns). Now INVALID_ARGUMENT; the session is
    as it was (history, kept messages, KV blocks), no block is left taken, and its next turn
    continues from the history."""
    sid = "zt/s"
    assert _events(node, _chat_turn("z1", "Name a colour.", "zt", sid))[-1]["type"] == "finished"
    sess = node.engine.sessions.sessions[sid]
    history, blocks = node.engine.session_history(sid), [b.block_id for b in sess.blocks]
    kept = list(node._session_messages[sid])
    used = node.stats()["used_blocks"]
    got = _events(node, _chat_turn("z2", "hi" + "\x04" * 20_000, "zt", sid))
    assert [e["type"] for e in got] == ["error"], got[-1]
    assert got[0]["code"] == "INVALID_ARGUMENT" and "characters the tokenizer drops" in got[0]["message"]
    assert node.engine.session_history(sid) == history
    assert [b.block_id for b in node.engine.sessions.sessions[sid].blocks] == blocks
    assert node._session_messages[sid] == kept
    assert node._session_messages.tenant_chars["zt"] == node._session_messages.chars(sid) == sum(
        len(m["content"]) for m in kept)
    assert asyncio.run(node.integrity_stats())["used_blocks"] == used and "z2" not in node._streams
    done = _events(node, _chat_turn("z3", "And another one?", "zt", sid))[-1]
    assert done["type"] == "finished" and done["prompt_tokens"] > len(history)
    assert node.engine.session_history(sid)[:len(history)] == history
    assert len(node._session_messages[sid]) == len(kept) + 2
    assert asyncio.run(node.close_session(sid, "zt")) > 0
    assert sid not in node._session_messages and "zt" not in node._session_messages.tenant_chars
    node.engine.check_integrity()


def test_a_tool_result_turn_keeps_its_tool_call_id_through_the_data_plane(node) -> None:
    """Review 25b N3: a session turn of a tool result (role "tool", with the ``tool_call_id``
    and ``name`` OpenAI's tool messages carry) crosses the data plane, renders as the chat
    template renders it with them, and is kept with them for the next turn; their characters
    count against the tenant's kept session text."""
    sid = "tt/s"
    tool = {"role": "tool", "content": "4", "tool_call_id": "call_1", "name": "add"}

    async def run():
        gw = await connect(node)
        await gw.submit(_chat_turn("t1", "What is 2+2? Call add.", "tt", sid))
        first = await gw.drain({"t1"})
        await gw.submit(request("t2", max_tokens=3, tokens=(), tenant="tt", session_id=sid, messages=(tool,)))
        return first, await gw.drain({"t2"})

    first, got = asyncio.run(run())
    assert first["t1"][-1]["type"] == "finished" and got["t2"][-1]["type"] == "finished", got
    kept = node._session_messages[sid]
    assert kept[0] == {"role": "user", "content": "What is 2+2? Call add."} and kept[2] == tool
    assert kept[1]["role"] == "assistant" and len(kept) == 4
    assert node._session_messages.chars(sid) == sum(
        len(m["content"]) + len(m.get("name", "")) + len(m.get("tool_call_id", "")) for m in kept)
    assert asyncio.run(node.close_session(sid, "tt")) > 0
    node.engine.check_integrity()


def test_a_sessions_whole_text_is_bounded_by_what_its_tokens_can_stand_for(node) -> None:
    """Regression (security review F3): only each turn's text was bounded (room x
    max_token_chars); now the session's kept messages and the new turn's together are."""
    sid = "wt/s"
    assert _events(node, _chat_turn("w1", "Name a colour.", "wt", sid))[-1]["type"] == "finished"
    room = min(node.engine.max_model_len, node.engine.scheduler.pool_tokens)
    bound = room * node.templater.max_token_chars
    history = node.engine.session_history(sid)
    turn = _chat_turn("w2", "x" * 100, "wt", sid)
    node._prompt(turn, history)  # fits
    node._session_messages.add(sid, "wt", [{"role": "user", "content": "y" * (bound - 120)}])
    with pytest.raises(ValueError, match="the session's messages"):
        node._prompt(turn, history)
    asyncio.run(node.close_session(sid, "wt"))
    assert "wt" not in node._session_messages.tenant_chars


def test_a_tenants_kept_session_text_on_a_node_is_bounded(node, monkeypatch) -> None:
    """Regression (security review F3): a tenant's sessions kept messages on a node without
    bound. A turn that would take them past ``max_session_text_chars_per_tenant`` is refused
    with RESOURCE_EXHAUSTED naming it, its session goes on; another tenant's turns run, and a
    closed session gives its characters back."""
    monkeypatch.setattr(node, "config", node.config.model_copy(update={"max_session_text_chars_per_tenant": 200}))
    assert _events(node, _chat_turn("b1", "Name a colour.", "bt", "bt/s"))[-1]["type"] == "finished"
    kept = node._session_messages.tenant_chars["bt"]
    assert kept == node._session_messages.chars("bt/s") >= len("Name a colour.")
    history = node.engine.session_history("bt/s")
    got = _events(node, _chat_turn("b2", "z" * (201 - kept), "bt", "bt/s"))
    assert [e["type"] for e in got] == ["error"] and got[0]["code"] == "RESOURCE_EXHAUSTED"
    assert "max_session_text_chars_per_tenant" in got[0]["message"]
    assert node.engine.session_history("bt/s") == history
    assert _events(node, _chat_turn("o1", "z" * (201 - kept), "ot", "ot/s"))[-1]["type"] == "finished"
    assert _events(node, _chat_turn("b3", "Why?", "bt", "bt/s"))[-1]["type"] == "finished"  # within it
    for sid, tenant in (("bt/s", "bt"), ("ot/s", "ot")):
        asyncio.run(node.close_session(sid, tenant))
    assert "bt" not in node._session_messages.tenant_chars and "ot" not in node._session_messages.tenant_chars
    assert _events(node, _chat_turn("b4", "z" * (201 - kept), "bt", "bt/s2"))[-1]["type"] == "finished"
    asyncio.run(node.close_session("bt/s2", "bt"))


def test_chat_turns_render_round_robin_over_tenants(node, monkeypatch) -> None:
    """Regression (security review 20 S4): the node's one render thread took chat requests
    first come first served across tenants, so another tenant's small turn waited behind every
    render one tenant had queued (3.04 s behind 20 turns of ~4.3K tokens). Now tenants with
    turns waiting take turns: B's one turn renders after at most one more of A's."""
    order: list[str] = []
    gate = threading.Event()
    real = node._prompt

    def slow(req, history, *templater):  # type: ignore[no-untyped-def]
        order.append(req.tenant)
        if len(order) == 1:
            assert gate.wait(30)
        return real(req, history, *templater)

    monkeypatch.setattr(node, "_prompt", slow)
    reqs = [request(f"rr-a{i}", 2, (), tenant="A", session_id=f"A/rr{i}",
                    messages=({"role": "user", "content": f"Hello number {i}"},)) for i in range(5)]
    reqs.append(request("rr-b", 2, (), tenant="B", session_id="B/rr",
                        messages=({"role": "user", "content": "What is the capital of France?"},)))

    async def run() -> list[str]:
        async def last(req: NodeRequest) -> str:
            events = [e async for e in node.generate(req)]
            return events[-1]["type"]

        tasks = [asyncio.create_task(last(r)) for r in reqs]
        await asyncio.sleep(0.3)  # every turn is queued behind the first A's render
        gate.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == ["finished"] * 6
    assert order.index("B") <= 2, order  # first come first served: 5
    assert not node.engine.check_integrity()


@pytest.mark.parametrize("min_tokens", [0, 2, 5])
def test_a_turn_without_max_tokens_past_the_context_is_refused_for_size_whatever_min_tokens(node, min_tokens) -> None:
    """Regression (s39 review r3 of 3c9b308): a chat session turn without ``max_tokens``
    (``fill_context``) whose prompt, rendered here with its history, fills the context was
    given max_tokens 1, which ``SamplingParams`` refused under a ``min_tokens`` of 2 or more:
    "min_tokens must be an integer in [0, max_tokens (1)], got 5", naming a max_tokens the
    client never sent. Lowering min_tokens cannot make it fit: it is refused for its size, in
    the words the gateway reads as the context overflow (``context_length_exceeded``)."""
    messages = ({"role": "user", "content": "Name a colour."},)
    req = NodeRequest(request_id=f"fill{min_tokens}", tenant="fill", cache_namespace="ns", token_ids=(),
                      session_id=f"fill/s{min_tokens}", messages=messages, max_context_tokens=8,
                      sampling=SamplingParams(max_tokens=max(1, min_tokens), min_tokens=min_tokens, ignore_eos=True),
                      extra={"fill_context": "1"})

    async def run() -> list[dict]:
        return [e async for e in node.generate(req)]

    error = asyncio.run(run())[-1]
    assert (error["type"], error["code"]) == ("error", "INVALID_ARGUMENT"), error
    assert re.match(rf"prompt \(\d+\) \+ max_tokens \({max(1, min_tokens)}\) exceeds the tenant's "
                    r"max_context_tokens \(8\)", error["message"]), error
