"""A Drain goes on only while the admin key that started it does (security hardening, session 37).

The fault: ``Drain`` confirmed its admin key at the scheduler when it was called, then waited
its ``timeout_s`` (any length) and aborted every request still running on every node. An admin
key rotated away meanwhile (a leaked one, its owner rotating it) still had its drain abort every
tenant's running requests at its end, as data streams of a rotated key ran on before session 36.

Now the gateway watches the key while the drain waits (``AdminServicer._while_admin``): once
the key's id is gone from the key directory the call ends UNAUTHENTICATED and each node's drain
is cancelled (``CacheNode.cancel_drain``), aborting nothing. A drain whose key stays valid
aborts what is still running at its end, as before.

The node's handle behaves as Ray's (``tests.loop_plane.Actor``): the gateway stopping its wait on
the node's drain does not stop that drain, as with Ray, so only ``cancel_drain`` does
(regression, review r1 F2: the harness cancelled the drain itself and a no-op
``cancel_drain`` passed).

The real path of tests/test_stream_key_revoked.py (its ``Plane``: a real cache node with the
tiny Llama, the scheduler on the real data plane, the gateway's gRPC edge), with the gateway's
``AdminServicer`` on a real gRPC server of its own; the key is rotated at the scheduler, as
through another gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from kvstrata.v1 import admin_pb2, admin_pb2_grpc
from services import key_ids
from services.gateway_admin import AdminServicer
from tests.loop_plane import Actor, call, wait_for
from tests.test_key_watch_unconfirmed import _silent_scheduler
from tests.test_stream_key_revoked import Plane, plane  # noqa: F401 - the fixture

CHECK_S = 0.5
"""How often the drain's admin key is checked here (``KEY_CHECK_S``, 5 s, by default)."""
STALENESS_MAX_S = 2.0
"""``key_staleness_max_s`` here (120 s by default)."""


@pytest.fixture(scope="module")
def admin(plane: Plane) -> Iterator[admin_pb2_grpc.AdminServiceStub]:  # noqa: F811
    """The gateway's AdminService on a gRPC server of its own, over ``plane``'s node and scheduler."""
    servicer = AdminServicer(Actor(plane.scheduler), plane.auth, {"n0": Actor(plane.node)},
                             key_check_s=CHECK_S, key_staleness_max_s=STALENESS_MAX_S)

    async def serve() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        admin_pb2_grpc.add_AdminServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = plane.run(serve())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield admin_pb2_grpc.AdminServiceStub(channel)
    channel.close()
    plane.run(server.stop(0))


def _drain(plane: Plane, admin: admin_pb2_grpc.AdminServiceStub, key: str, timeout_s: float):  # noqa: F811
    """A Drain call in the background: its future gives ``(status code, aborted)``."""

    def run() -> tuple[grpc.StatusCode, int]:
        try:
            reply = admin.Drain(admin_pb2.DrainRequest(timeout_s=timeout_s),
                                metadata=(("authorization", f"Bearer {key}"),), timeout=60)
        except grpc.RpcError as err:
            return err.code(), -1
        return grpc.StatusCode.OK, reply.aborted

    return plane.pool.submit(run)


def test_a_drain_ends_when_its_admin_key_is_rotated_away_and_aborts_nothing(
        plane: Plane, admin: admin_pb2_grpc.AdminServiceStub) -> None:  # noqa: F811
    """ann streams; a Drain with 60 s to wait is running when its admin key is rotated away at
    another gateway. The call ends UNAUTHENTICATED within a check, the node's drain is
    cancelled, and ann's stream runs on (nothing aborts it at the drain's end). Old code: the
    call went on waiting (and would have aborted ann's request at 60 s). Then a drain made with
    the new key, 1 s to wait, aborts ann's request as before."""
    key = plane.run(call(plane.scheduler.rotate_admin_key))
    ann, ann_key = plane.register("dann")
    anns = plane.grpc_stream(ann_key)
    wait_for(lambda: plane.node_streams() == {ann: 1}, 30)
    drain = _drain(plane, admin, key, 60.0)
    wait_for(lambda: len(plane.node._drains) == 1, 10)  # waiting on the node
    t0 = time.monotonic()
    new_key = plane.run(call(plane.scheduler.rotate_admin_key))  # at another gateway
    code, _ = drain.result(10)
    assert code == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - t0 < CHECK_S + 3.0, code
    wait_for(lambda: plane.node._drains == {}, 5)  # cancelled: it returned, aborting nothing
    time.sleep(CHECK_S)
    assert not anns.done() and plane.node_streams() == {ann: 1}

    code, aborted = _drain(plane, admin, new_key, 1.0).result(30)
    assert (code, aborted) == (grpc.StatusCode.OK, 1)
    assert anns.result(30)[0] == grpc.StatusCode.OK  # finish reason abort
    wait_for(lambda: plane.node_streams() == {} and plane.in_flight() == 0, 10)


def test_a_drain_ends_unavailable_when_its_key_cannot_be_confirmed_and_aborts_nothing(
        plane: Plane, admin: admin_pb2_grpc.AdminServiceStub) -> None:  # noqa: F811
    """bea streams; a Drain with 60 s to wait is running when the scheduler goes silent to this
    gateway (its key directory does not answer). Past ``key_staleness_max_s`` (two failed
    checks in a row) the call ends UNAVAILABLE, the node's drain is cancelled (it would go on
    60 s otherwise: the node's handle behaves as Ray's), and bea's stream runs on (the key
    watch's own bound is 30 s here). Review r1 F2: this branch was untested."""
    key = plane.run(call(plane.scheduler.rotate_admin_key))
    bea, bea_key = plane.register("dbea")
    beas = plane.grpc_stream(bea_key)
    wait_for(lambda: plane.node_streams() == {bea: 1}, 30)
    drain = _drain(plane, admin, key, 60.0)
    wait_for(lambda: len(plane.node._drains) == 1, 10)  # waiting on the node
    directory = plane.auth.directory
    reachable, t0 = directory.scheduler, time.monotonic()
    try:
        directory.scheduler = _silent_scheduler(plane)
        code, _ = drain.result(STALENESS_MAX_S + 3 * CHECK_S + 5.0)
        took = time.monotonic() - t0
    finally:
        directory.scheduler = reachable
    assert code == grpc.StatusCode.UNAVAILABLE and STALENESS_MAX_S - CHECK_S < took, (code, took)
    wait_for(lambda: plane.node._drains == {}, 5)  # cancelled: it returned, aborting nothing
    time.sleep(CHECK_S)
    assert not beas.done() and plane.node_streams() == {bea: 1}
    beas.call.cancel()  # type: ignore[attr-defined]
    assert beas.result(30)[0] == grpc.StatusCode.CANCELLED
    wait_for(lambda: plane.node_streams() == {} and plane.in_flight() == 0, 10)


class _Context:
    """A gRPC servicer context with an admin key: ``abort`` raises what it was given."""

    def __init__(self, key: str) -> None:
        self.key = key

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.key}"),)

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Aborted(code, message)


class _Aborted(Exception):
    pass


def test_one_failed_check_past_the_bound_ends_no_drain(plane: Plane) -> None:  # noqa: F811
    """``_while_admin`` with its key checked every 0.05 s and a bound (0.01 s) that every
    check passes: with the scheduler silent, the first failed check ends nothing, the second
    in a row ends the call UNAVAILABLE (as the key watch: one failed refresh, a restart or a
    timeout, ends nothing). Regression (review r1 F4, session 37): the first failure ended it."""
    key = plane.run(call(plane.scheduler.rotate_admin_key))
    directory = plane.auth.directory
    servicer = AdminServicer(Actor(plane.scheduler), plane.auth, {}, key_check_s=0.05, key_staleness_max_s=0.01)
    asked: list[str] = []
    which_exist = directory.which_exist

    async def counted(key_ids: set[str]) -> tuple[str, set[str]]:
        outcome, existing = await which_exist(key_ids)
        asked.append(outcome)
        return outcome, existing

    async def run() -> BaseException:
        waiting = asyncio.get_running_loop().create_future()  # a drain that never answers
        try:
            await servicer._while_admin(_Context(key), waiting)
        except _Aborted as err:
            return err
        finally:
            waiting.cancel()
        raise AssertionError("_while_admin returned")

    reachable = directory.scheduler
    try:
        directory.scheduler, directory.which_exist = _silent_scheduler(plane), counted
        err = plane.run(run(), 10)
    finally:
        directory.scheduler = reachable
        del directory.which_exist
    assert err.args[0] == grpc.StatusCode.UNAVAILABLE and asked == ["unreachable"] * 2, (err.args, asked)


def test_an_unusable_directory_ends_no_drain_and_the_key_is_asked_about_alone(plane: Plane, monkeypatch) -> None:  # noqa: F811
    """The store holds more key ids than a directory may (``_MAX_DIRECTORY_IDS``, 2**18; 1 here)
    and the scheduler answers: ``_while_admin`` (checks every 0.05 s, a 0.01-s bound) goes on
    (its key confirmed through ``key_ids_exist``) until the admin key is rotated away, then
    ends UNAUTHENTICATED. Regression (review r1 F1, session 37): every refresh was refused as
    too large and counted as no answer, so the drain ended UNAVAILABLE at once."""
    key = plane.run(call(plane.scheduler.rotate_admin_key))
    plane.register("dcap")
    monkeypatch.setattr(key_ids, "_MAX_DIRECTORY_IDS", 1)
    directory = plane.auth.directory
    monkeypatch.setattr(directory, "ids", set())  # a fresh gateway's: every refresh gets every id
    monkeypatch.setattr(directory, "_epoch", "")
    servicer = AdminServicer(Actor(plane.scheduler), plane.auth, {}, key_check_s=0.05, key_staleness_max_s=0.01)

    async def run() -> tuple[str, grpc.StatusCode | None]:
        waiting = asyncio.get_running_loop().create_future()  # a drain that never answers
        watching = asyncio.ensure_future(servicer._while_admin(_Context(key), waiting))
        try:
            await asyncio.sleep(1.0)  # ~20 checks
            if watching.done():
                return "ended early", getattr(watching.exception(), "args", (None,))[0]
            await call(plane.scheduler.rotate_admin_key)  # at another gateway
            await asyncio.wait_for(asyncio.shield(watching), 5)
        except _Aborted as err:
            return "rotated", err.args[0]
        finally:
            waiting.cancel()
            watching.cancel()
        return "returned", None

    assert plane.run(run(), 20) == ("rotated", grpc.StatusCode.UNAUTHENTICATED)
    assert not directory.loaded or len(directory.ids) <= 1


def test_a_drain_whose_client_stops_waiting_is_called_off(
        plane: Plane, admin: admin_pb2_grpc.AdminServiceStub) -> None:  # noqa: F811
    """A Drain of 3 s whose client's deadline is 1 s (as a Ctrl-C or a dropped connection ends
    the call): the call ends DEADLINE_EXCEEDED, the node's drain is cancelled, and cid's
    request still runs after the 3 s (nothing aborted). The behaviour documented since 72f3ceb
    (review r1 F3: it was undocumented); the node's handle behaves as Ray's, so only
    ``cancel_drain`` stops the node's drain."""
    key = plane.run(call(plane.scheduler.rotate_admin_key))
    cid, cid_key = plane.register("dcid")
    cids = plane.grpc_stream(cid_key)
    wait_for(lambda: plane.node_streams() == {cid: 1}, 30)
    with pytest.raises(grpc.RpcError) as err:
        admin.Drain(admin_pb2.DrainRequest(timeout_s=3.0), metadata=(("authorization", f"Bearer {key}"),), timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: plane.node._drains == {}, 5)
    time.sleep(2.5)  # past the drain's 3 s
    assert not cids.done() and plane.node_streams() == {cid: 1}
    cids.call.cancel()  # type: ignore[attr-defined]
    assert cids.result(30)[0] == grpc.StatusCode.CANCELLED
    wait_for(lambda: plane.node_streams() == {} and plane.in_flight() == 0, 10)
