"""A Drain goes on only while the admin key that started it does (security hardening, session 37).

The fault: ``Drain`` confirmed its admin key at the scheduler when it was called, then waited
its ``timeout_s`` (any length) and aborted every request still running on every node. An admin
key rotated away meanwhile (a leaked one, its owner rotating it) still had its drain abort every
tenant's running requests at its end, as data streams of a rotated key ran on before session 36.

Now the gateway watches the key while the drain waits (``AdminServicer._while_admin``): once
the key's id is gone from the key directory the call ends UNAUTHENTICATED and each node's drain
is cancelled (``CacheNode.cancel_drain``), aborting nothing. A drain whose key stays valid
aborts what is still running at its end, as before.

The real path of tests/test_stream_key_revoked.py (its ``Plane``: a real cache node with the
tiny Llama, the scheduler on the real data plane, the gateway's gRPC edge), with the gateway's
``AdminServicer`` on a real gRPC server of its own; the key is rotated at the scheduler, as
through another gateway.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from kvstrata.v1 import admin_pb2, admin_pb2_grpc
from services.gateway_admin import AdminServicer
from tests.loop_plane import Actor, call, wait_for
from tests.test_stream_key_revoked import Plane, plane  # noqa: F401 - the fixture

CHECK_S = 0.5
"""How often the drain's admin key is checked here (``KEY_CHECK_S``, 5 s, by default)."""


@pytest.fixture(scope="module")
def admin(plane: Plane) -> Iterator[admin_pb2_grpc.AdminServiceStub]:  # noqa: F811
    """The gateway's AdminService on a gRPC server of its own, over ``plane``'s node and scheduler."""
    servicer = AdminServicer(Actor(plane.scheduler), plane.auth, {"n0": Actor(plane.node)}, key_check_s=CHECK_S)

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
