"""The data plane with its CURVE keys, over real sockets, without Ray: a real CacheNode (the
real model), a real GlobalSchedulerService and the gateway's real ``NodeStreams``, each
serving on a background event loop as in their actors.

- a peer without the deployment's keys gets nothing run and nothing back;
- every serving socket is bound on loopback when so configured;
- every reader (node commands, scheduler admissions, gateway events and admission replies)
  drops and counts random bytes and mistyped messages and keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.data_plane_auth import DataPlaneKeys, KeyPair
from services.gateway_streams import NodeStreams
from services.global_scheduler_admission import GlobalSchedulerService
from services.node_request import NodeRequest
from tests.known_tenants import know_tenants

PROMPT = (1, 504, 3575, 28, 614, 1242, 314, 216, 1241, 2406, 30, 2)


def request(rid: str, max_tokens: int = 3) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=PROMPT,
                       sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@dataclass
class Plane:
    keys: DataPlaneKeys
    loop: asyncio.AbstractEventLoop
    node: CacheNode
    scheduler: GlobalSchedulerService
    streams: NodeStreams
    fake_scheduler: Any  # a ROUTER with the scheduler's keys, for a second NodeStreams
    replies_to: NodeStreams  # that second gateway, whose admission replies the tests forge

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def sender(self, role: str | None, kind: int = zmq.PUSH, server_role: str = "node",
               address: str = "") -> zmq.Socket:
        """A plain socket connected to ``address``: with ``role``'s keys, or none (None)."""
        sock = zmq.Context.instance().socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if role is not None:  # a node sends with its own client key (n0's)
            self.keys.security(role, node_id="n0" if role == "node" else "").connect_to(sock, server_role)
        sock.connect(address)
        return sock

    def generate(self, rid: str, max_tokens: int = 3) -> list[dict[str, Any]]:
        """One request through the whole data plane: admission, node, events; its events."""
        async def go() -> list[dict[str, Any]]:
            queue = self.streams.open(rid)
            try:
                adm = await self.streams.admit(request(rid, max_tokens), [])
                assert adm.code == "OK", adm
                self.streams.bind(rid, adm.node_id)  # as the gateway does: events from its node
                events = [await asyncio.wait_for(queue.get(), 60)]
                while events[-1]["type"] not in ("finished", "error"):
                    events.append(await asyncio.wait_for(queue.get(), 60))
                return events
            finally:
                self.streams.close(rid)
                self.scheduler.release(rid)

        return self.run(go())


def wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def plane() -> Iterator[Plane]:
    keys = DataPlaneKeys.generate(("n0", "n1"))  # each node its own client key, as the launcher
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    node = CacheNode("n0", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0), num_threads=1,
                     security=keys.security("node", node_id="n0"))
    scheduler = GlobalSchedulerService(tempfile.mkdtemp(prefix="kvstrata-dp-"), {"n0": 4},
                                       security=keys.security("scheduler"))
    know_tenants(scheduler, "t")
    node_address = run(node.open_data_plane())
    scheduler.attach_nodes({"n0": node_address})
    sched_address = run(scheduler.open_data_plane())
    streams = NodeStreams({"n0": None}, {"n0": node_address}, sched_address,
                          security=keys.security("gateway"))
    run(streams.start())

    async def fake() -> tuple[Any, Any, NodeStreams]:
        ctx = data_plane.context(asyncio_=True)
        auth = keys.security("scheduler").start_authenticator(ctx)
        router, address = data_plane.serving_socket(ctx, zmq.ROUTER, keys.security("scheduler"))
        other = NodeStreams({"n0": None}, {"n0": node_address}, address, admit_timeout_s=5.0,
                            security=keys.security("gateway"))
        await other.start()
        return router, auth, other

    router, auth, other = run(fake())
    yield Plane(keys, loop, node, scheduler, streams, router, other)

    async def close() -> None:
        streams.shutdown()
        other.shutdown()
        auth.stop()
        router.context.destroy(linger=0)
        scheduler.close_data_plane()
        node.close_data_plane()

    run(close())
    node.shutdown()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_a_peer_without_the_keys_gets_nothing_run(plane: Plane) -> None:
    """issue 18 fault 3: the data plane trusted anyone. Its sockets bound on the node's
    network address without authentication, so whoever reached the port could submit a
    request with any tenant, namespace, SLO and quota, bypassing API keys and admission. Now
    every socket is CURVE-authenticated (bound on loopback here): a peer with no keys, or with
    keys of its own, gets no request run and nothing back, and the node never reads a byte of
    what it sent; the gateway's keys get a request run."""
    node_address = plane.node.data_address
    sched_address = plane.scheduler.data_address
    assert node_address.startswith("tcp://127.0.0.1:") and sched_address.startswith("tcp://127.0.0.1:")
    assert plane.streams.subscriber.startswith("tcp://127.0.0.1:")
    assert plane.node._inbox[0].getsockopt(zmq.LAST_ENDPOINT).decode() == node_address

    loot = zmq.Context.instance().socket(zmq.PULL)  # the attacker's own event inbox
    loot.setsockopt(zmq.LINGER, 0)
    loot_address = data_plane.bind_random(loot, "127.0.0.1")
    commands, bad = plane.node.commands_received, plane.node.bad_messages
    own = KeyPair.generate()
    attackers = [plane.sender(None, address=node_address)]
    curve = zmq.Context.instance().socket(zmq.PUSH)  # CURVE, knowing the node's public key
    curve.setsockopt(zmq.LINGER, 0)
    curve.curve_secretkey, curve.curve_publickey = own.secret, own.public
    curve.curve_serverkey = plane.keys.pairs["node"].public
    curve.connect(node_address)
    attackers.append(curve)
    submit = data_plane.pack({"op": "submit", "req": data_plane.request_to_wire(request("evil", 2)),
                              "sub": loot_address})
    sched_attacker = plane.sender(None, zmq.DEALER, address=sched_address)
    admission = data_plane.pack({"id": 1, "req": data_plane.request_to_wire(request("evil2", 2)),
                                 "sub": loot_address, "hashes": []})
    for sock, payload in [(a, submit) for a in attackers] + [(sched_attacker, admission)]:
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        try:  # without a completed handshake a send has nowhere to go
            sock.send(payload)
        except zmq.Again:
            pass
    assert loot.poll(3000) == 0  # nothing came back
    assert sched_attacker.poll(0) == 0
    assert (plane.node.commands_received, plane.node.bad_messages) == (commands, bad)
    assert "evil" not in plane.node._streams and "evil2" not in plane.scheduler.requests

    events = plane.generate("legit", max_tokens=3)
    assert [e["type"] for e in events] == ["started", "delta", "delta", "delta", "finished"]
    assert events[-1]["completion_tokens"] == 3
    assert plane.node.commands_received == commands + 1
    for sock in (*attackers, sched_attacker, loot):
        sock.close()


JUNK = st.one_of(
    st.binary(max_size=256),  # random bytes
    st.builds(msgpack.packb, st.recursive(  # well-formed msgpack of any shape
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
        | st.binary(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )),
)


_INT = st.integers(-(2**63), 2**63 - 1)
_NOT_A_STRING = st.one_of(st.none(), _INT, st.lists(_INT, max_size=2))
_BAD_FIELDS = {  # per field, values it must never accept
    "request_id": _NOT_A_STRING | st.just("") | st.just("x" * 5000),
    "tenant": _NOT_A_STRING | st.just(""),
    "cache_namespace": _NOT_A_STRING,
    "session_id": _NOT_A_STRING,
    "sampling": st.one_of(st.none(), _INT, st.dictionaries(
        st.sampled_from(["max_tokens", "temperature", "top_p", "nope"]),
        st.one_of(st.text(max_size=3), st.integers(-(2**63), -1)), min_size=1)),
    "token_ids": st.one_of(st.text(max_size=3), st.lists(st.integers(2**31, 2**63 - 1), min_size=1, max_size=3),
                           st.lists(st.integers(-(2**63), -1), min_size=1, max_size=3)),
    "extra": st.dictionaries(st.text(max_size=4), _INT, min_size=1, max_size=2),
    "messages": st.one_of(_INT, st.lists(_INT, min_size=1, max_size=2)),
    "max_context_tokens": st.one_of(st.text(max_size=3), st.none(), st.floats()),
    "prefetch": st.one_of(_INT, st.text(max_size=3)),
    "unknown": _INT,
}
MISTYPED_SUBMITS = st.builds(  # the right shape with a wrong, missing-made or huge field value
    lambda changes: msgpack.packb({"op": "submit", "sub": "tcp://127.0.0.1:1", "req": {
        **data_plane.request_to_wire(request("fuzz")), **changes}}),
    st.fixed_dictionaries({}, optional=_BAD_FIELDS).filter(bool),
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(payloads=st.lists(JUNK, min_size=1, max_size=8))
def test_node_command_reader_drops_and_counts_bad_messages(plane: Plane, payloads: list[bytes]) -> None:
    """issue 18 fault 4 (data plane): a malformed message killed the node's command reader for
    good. Random bytes and msgpack of any shape from an authenticated peer are dropped and
    counted (stats()["data_plane"]["bad_messages"]), and the reader keeps serving."""
    before = plane.node.bad_messages
    sock = plane.sender("gateway", address=plane.node.data_address)
    for payload in payloads:
        sock.send(payload)
    wait_for(lambda: plane.node.bad_messages == before + len(payloads))
    sock.close()
    assert plane.node.stats()["data_plane"]["bad_messages"] == plane.node.bad_messages


def test_mistyped_requests_are_dropped_and_the_node_serves_on(plane: Plane) -> None:
    """issue 18 fault 4 (data plane): a submit of the right shape with mistyped, missing or
    huge fields runs nothing and is counted; a valid request after them completes."""
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payload=MISTYPED_SUBMITS)
    def one(payload: bytes) -> None:
        before = plane.node.bad_messages, plane.node.commands_received
        sock = plane.sender("gateway", address=plane.node.data_address)
        sock.send(payload)
        wait_for(lambda: (plane.node.bad_messages, plane.node.commands_received) != before)
        sock.close()
        assert (plane.node.bad_messages, plane.node.commands_received) == (before[0] + 1, before[1])

    one()
    assert not plane.node._streams
    events = plane.generate("after-node-fuzz")
    assert events[-1]["type"] == "finished" and events[-1]["completion_tokens"] == 3


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(payloads=st.lists(JUNK, min_size=1, max_size=8))
def test_scheduler_admission_server_drops_and_counts_bad_messages(plane: Plane, payloads: list[bytes]) -> None:
    """issue 18 fault 4 (data plane): the scheduler's admission server survives and counts
    any bytes from a gateway (answering an error where the message has a readable id)."""
    before = plane.scheduler.bad_messages
    sock = plane.sender("gateway", zmq.DEALER, "scheduler", plane.scheduler.data_address)
    for payload in payloads:
        sock.send(payload)
    wait_for(lambda: plane.scheduler.bad_messages == before + len(payloads))
    while sock.poll(200):
        reply = data_plane.unpack(sock.recv())
        assert set(reply) == {"id", "error"}
    sock.close()
    assert plane.scheduler.stats()["bad_messages"] == plane.scheduler.bad_messages


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(payloads=st.lists(JUNK, min_size=1, max_size=8))
def test_gateway_readers_drop_and_count_bad_messages(plane: Plane, payloads: list[bytes]) -> None:
    """issue 18 fault 4 (data plane): a malformed message killed the gateway's event and
    admission readers for good. Both drop and count any bytes, from a node (events) and
    from the scheduler (admission replies), and keep serving."""
    before = plane.streams.bad_messages
    sock = plane.sender("node", server_role="gateway", address=plane.streams.subscriber)
    for payload in payloads:
        sock.send(payload)
    wait_for(lambda: plane.streams.bad_messages == before + len(payloads))
    sock.close()

    other = plane.replies_to
    before = other.bad_messages

    async def forge() -> None:  # the admission's reply comes after a burst of bad ones
        admission = asyncio.ensure_future(other.admit(request("r"), []))
        peer, _ = await plane.fake_scheduler.recv_multipart()
        for payload in payloads:
            await plane.fake_scheduler.send_multipart([peer, payload])
        await plane.fake_scheduler.send_multipart([peer, data_plane.pack({"id": other._next_id, "adm": {
            "node_id": "n0", "code": "OK", "message": "", "retry_after_s": 0.0, "spill_blocks": 0,
            "reason": "", "continues_session": False}})])
        adm = await admission
        assert (adm.code, adm.node_id) == ("OK", "n0")

    plane.run(forge())
    assert other.bad_messages == before + len(payloads)


def test_every_reader_yields_between_queued_messages(plane: Plane) -> None:
    """Regression (review s34 B F3): pyzmq's ``recv`` of a message already queued returns a
    done future, and no reader yielded otherwise, so a backlog was read in one loop turn: the
    scheduler's Ray calls (``health``, ``release``) waited behind a burst of admissions (15 s
    for 256 of 131,072 token ids), a node's behind its commands, a gateway's behind a node's
    events. Each reader (scheduler admissions, node commands, gateway events and admission
    replies) gets a backlog queued while its loop is blocked; a task run as a Ray call is
    (ready before the socket is read) must see some of it read, not none then all."""
    count = 60

    async def backlog(send: Any, done: Any) -> list[int]:
        """``send`` the backlog, block the loop until it sits in the socket, then see how much
        of it ``done()`` counts at each turn a concurrent task gets."""
        before = done()
        send()
        time.sleep(0.5)  # noqa: ASYNC251 - the loop blocked: every message is queued in the socket
        seen: list[int] = []

        async def turns() -> None:
            while done() - before < count:
                seen.append(done() - before)
                await asyncio.sleep(0)

        await asyncio.wait_for(turns(), 30)
        return seen

    def check(seen: list[int], reader: str) -> None:
        assert any(0 < n < count for n in seen), f"{reader}: the loop ran nothing else while it read {count} " \
            f"queued messages (a concurrent task saw {sorted(set(seen))} of them done)"

    junk = b"\xc1"  # never msgpack: dropped and counted
    sched = plane.sender("gateway", zmq.DEALER, "scheduler", plane.scheduler.data_address)
    node = plane.sender("gateway", address=plane.node.data_address)
    events = plane.sender("node", server_role="gateway", address=plane.streams.subscriber)
    time.sleep(0.2)  # connected (CURVE handshakes) before the loop is blocked
    try:
        check(plane.run(backlog(lambda: [sched.send(junk) for _ in range(count)],
                                lambda: plane.scheduler.bad_messages)), "the scheduler's admissions")
        check(plane.run(backlog(lambda: [node.send(data_plane.pack({"op": "abort", "id": f"yield-{i}"}))
                                         for i in range(count)],
                                lambda: plane.node.commands_received)), "the node's commands")
        check(plane.run(backlog(lambda: [events.send(junk) for _ in range(count)],
                                lambda: plane.streams.bad_messages)), "the gateway's events")
    finally:
        for sock in (sched, node, events):
            sock.close()

    other = plane.replies_to

    async def replies() -> list[int]:  # the fake scheduler learns the gateway's peer id first
        admission = asyncio.ensure_future(other.admit(request("yield-reply"), []))
        peer, _ = await plane.fake_scheduler.recv_multipart()

        def send() -> None:
            for _ in range(count):
                plane.fake_scheduler.send_multipart([peer, junk])  # (sent at once: room in its queue)

        seen = await backlog(send, lambda: other.bad_messages)
        await plane.fake_scheduler.send_multipart([peer, data_plane.pack({"id": other._next_id, "adm": {
            "node_id": "n0", "code": "OK", "message": "", "retry_after_s": 0.0, "spill_blocks": 0,
            "reason": "", "continues_session": False}})])
        assert (await admission).code == "OK"
        return seen

    check(plane.run(replies()), "the gateway's admission replies")


def test_everything_serves_after_the_fuzz(plane: Plane) -> None:
    """After every reader has had its bad messages, a request still goes end to end."""
    events = plane.generate("after-fuzz", max_tokens=2)
    assert events[-1]["type"] == "finished" and events[-1]["completion_tokens"] == 2


def test_data_plane_ports_are_in_the_documented_range() -> None:
    """A new-user check found data-plane ports at 32829-41347 while deploy/README tells
    firewalls to open 49152-65535 (newer pyzmq lets the OS pick any port): every bind stays in
    the documented range."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PULL) for _ in range(20)]
    try:
        ports = [int(data_plane.bind_random(s, "127.0.0.1").rsplit(":", 1)[1]) for s in socks]
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
    assert all(49152 <= p <= 65535 for p in ports), ports
    assert len(set(ports)) == 20


@pytest.mark.parametrize("sampling", [
    {"max_tokens": 4, "top_p": "0.5"}, {"max_tokens": 4, "ignore_eos": "yes"}, {"max_tokens": 4, "ignore_eos": 1},
    {"max_tokens": 4, "stop_token_ids": ["7"]}, {"max_tokens": 4, "stop": [7]}, {"max_tokens": 4, "seed": True},
    {"max_tokens": True}, {"max_tokens": 4, "temperature": None}, {"max_tokens": 4, "frobs": 1},
])
def test_sampling_fields_off_the_wire_have_their_exact_types(sampling) -> None:
    """Regression (security review): ``request.sampling`` went to ``SamplingParams`` unchecked,
    which coerced "0.5" for its check but kept the string: sampling raised inside the step and
    failed every request in it."""
    from services.node_request import NodeRequest

    wire = data_plane.request_to_wire(NodeRequest(request_id="r", tenant="t", cache_namespace="ns",
                                                  token_ids=(1, 2), sampling=SamplingParams(max_tokens=4)))
    assert data_plane.request_from_wire(wire).sampling == SamplingParams(max_tokens=4)
    with pytest.raises((TypeError, ValueError)):
        data_plane.request_from_wire({**wire, "sampling": sampling})


def test_the_gateways_key_sends_aborts_only(plane: Plane) -> None:
    """Regression (security review): the node's inbox took any op from either role it admits,
    so the gateway's key could submit a request past admission (any tenant, namespace, quota)
    or end any tenant's work. The gateway sends aborts; submits, gateway-gone and
    tenant-deleted come from the scheduler's key alone."""
    loot = zmq.Context.instance().socket(zmq.PULL)
    loot.setsockopt(zmq.LINGER, 0)
    loot_address = data_plane.bind_random(loot, "127.0.0.1")
    gateway = plane.sender("gateway", address=plane.node.data_address)
    bad = plane.node.bad_messages
    for msg in ({"op": "submit", "req": data_plane.request_to_wire(request("forged", 2)), "sub": loot_address},
                {"op": "end_tenant", "tenant": "t"}, {"op": "abort_subscriber", "sub": loot_address}):
        gateway.send(data_plane.pack(msg))
    commands = plane.node.commands_received
    gateway.send(data_plane.pack({"op": "abort", "id": "no-such-request"}))
    deadline = time.monotonic() + 10
    while plane.node.commands_received == commands and time.monotonic() < deadline:
        time.sleep(0.05)
    assert plane.node.bad_messages == bad + 3 and plane.node.commands_received == commands + 1
    assert loot.poll(500) == 0 and "forged" not in plane.node._streams
    assert plane.generate("after", max_tokens=2)[-1]["type"] == "finished"  # the scheduler's submits run
    gateway.close()
    loot.close()


def test_a_node_cannot_write_into_another_nodes_streams(plane: Plane) -> None:
    """Regression (security review): every node shared one key pair and the gateway never
    checked who sent an event, so any node could write tokens into the streams of requests on
    another node. Each node now has its own client key: an event for a request bound to n0
    from n1's key is dropped and counted, and so is one that arrives before the request is
    bound (held until ``bind``); the shared node key gets no connection."""
    async def go() -> tuple[list[dict[str, Any]], int]:
        queue = plane.streams.open("victim")
        try:
            bad = plane.streams.bad_messages
            forged = data_plane.pack([["victim", {"type": "delta", "token_ids": [66], "text": "PWNED"}]])
            for who in ("n1", None, "bind", "n1"):  # another node's key (before and after the
                # request is bound to n0), the old shared node key
                if who == "bind":
                    adm = await plane.streams.admit(request("victim", 40), [])
                    plane.streams.bind("victim", adm.node_id)
                    continue
                sock = data_plane.context(asyncio_=True).socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sec = plane.keys.security("node", node_id=who) if who else plane.keys.security("node")
                sec.connect_to(sock, "gateway")
                sock.connect(plane.streams.subscriber)
                if who:  # a node's own key connects: the send waits for its handshake, however slow
                    await asyncio.wait_for(sock.send(forged), 60)
                else:  # the shared key never connects
                    with contextlib.suppress(zmq.Again):
                        await sock.send(forged, flags=zmq.NOBLOCK)
                await asyncio.sleep(0.5)
                sock.close(linger=0)
            events = [await asyncio.wait_for(queue.get(), 60)]
            while events[-1]["type"] not in ("finished", "error"):
                events.append(await asyncio.wait_for(queue.get(), 60))
            deadline = time.monotonic() + 30  # (a loaded machine delivers the forged events late)
            while plane.streams.bad_messages - bad < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return events, plane.streams.bad_messages - bad
        finally:
            plane.streams.close("victim")
            plane.scheduler.release("victim")

    events, dropped = plane.run(go())
    assert events[-1]["type"] == "finished" and dropped == 2
    assert all("PWNED" not in e.get("text", "") for e in events)


def test_another_nodes_event_does_not_move_a_streams_prompt_logprobs_count(plane: Plane) -> None:
    """Review 28l F5: the gateway counted an event's prompt-logprobs entries before it checked
    the event's sender, so another node's event, though dropped, used up the stream's count and
    the serving node's correct entries then ended the stream as malformed (UNAVAILABLE). Now
    only the serving node's events are counted."""
    from services.node_request import prompt_logprobs_entry

    prompt = (3, 42, 7, 42)

    def entries(*tokens: int) -> list[list[Any]]:
        return [prompt_logprobs_entry(t, -1.0, 1, [(t, -1.0), (9, -2.0)]) for t in tokens]

    def delta(*tokens: int) -> dict[str, Any]:
        return {"type": "delta", "token_ids": [], "text": "", "prompt_logprobs": entries(*tokens)}

    async def send(node_id: str, items: list[list[Any]]) -> None:
        sock = data_plane.context(asyncio_=True).socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        plane.keys.security("node", node_id=node_id).connect_to(sock, "gateway")
        sock.connect(plane.streams.subscriber)
        await asyncio.wait_for(sock.send(data_plane.pack(items)), 60)
        await asyncio.sleep(0.3)
        sock.close(linger=0)

    async def go() -> list[dict[str, Any]]:
        queue = plane.streams.open("pl", prompt_logprobs=2, prompt=prompt)
        try:
            plane.streams.bind("pl", "n0")  # (never admitted: only these sockets send for it)
            started = {"type": "started", "request_id": "pl", "node_id": "n0", "prompt_tokens": 4}
            await send("n0", [["pl", started]])
            await send("n1", [["pl", delta(42, 7, 42)]])  # another node's: dropped, counts nothing
            await send("n0", [["pl", delta(42, 7, 42)], ["pl", {"type": "delta", "token_ids": [5], "text": "x"}]])
            got = [await asyncio.wait_for(queue.get(), 30)]  # (deltas the reader did not take coalesce)
            while got[-1]["type"] != "error" and 5 not in got[-1].get("token_ids", ()):
                got.append(await asyncio.wait_for(queue.get(), 30))
            return got
        finally:
            plane.streams.close("pl")

    got = plane.run(go())
    assert got[0]["type"] == "started" and all(e["type"] == "delta" for e in got[1:]), got
    assert [e[0] for d in got[1:] for e in d.get("prompt_logprobs", ())] == [42, 7, 42]


def test_reprs_of_data_plane_identities_leave_the_secret_keys_out() -> None:
    """A ``repr`` of a key pair, of a deployment's keys or of one process's identity (a log
    line, a traceback with locals) shows no CURVE secret key (review s34 B: the dataclasses'
    default ``repr`` printed them)."""
    from services.data_plane_auth import DataPlaneKeys

    keys = DataPlaneKeys.generate(("n0", "n1"))
    shown = repr(keys) + "".join(repr(keys.security(role, node_id="n0" if role == "node" else ""))
                                 for role in keys.pairs)
    secrets = [pair.secret for pair in [*keys.pairs.values(), *keys.node_clients.values()]]
    assert all(pair.public.decode() in shown for pair in keys.pairs.values())  # (the reprs are there)
    assert not [s for s in secrets if s.decode() in shown]
    # nor a running deployment's handles (``launcher.Services``) its admin key (diff review s34 F3)
    from services.config import ServiceConfig
    from services.launcher import Services

    services = Services(scheduler=None, nodes={}, gateway=None, port=1, admin_key="sk-admin-secret",
                        config=ServiceConfig(), data_plane_keys=keys)
    assert "sk-admin-secret" not in repr(services) and not [s for s in secrets if s.decode() in repr(services)]
