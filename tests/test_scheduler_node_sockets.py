"""The GlobalScheduler's command sockets to the cache nodes' inboxes (``Membership``): one per
inbox in use, never one per inbox a node ever had.

Real ``data_plane.PushSockets`` and real ZeroMQ ``PULL`` inboxes on loopback (plaintext), a
plain ``GlobalScheduler`` and no Ray: a node's "restart" is its old inbox closed and a new one
bound, reported as Ray's restart is (``node_down``, ``node_up`` with a new pid).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.global_scheduler import GlobalScheduler
from services.node_request import NodeRequest
from tests.known_tenants import know_tenants

GATEWAY_INBOX = "tcp://127.0.0.1:9"


class Inboxes:
    """Nodes' command inboxes: bound ``PULL`` sockets, by address."""

    def __init__(self) -> None:
        self.context = data_plane.context()
        self.socks: dict[str, zmq.Socket] = {}

    def open(self) -> str:
        sock, address = data_plane.serving_socket(self.context, zmq.PULL, None)
        self.socks[address] = sock
        return address

    def close(self, address: str) -> None:
        self.socks.pop(address).close(linger=0)

    def receive(self, address: str, timeout_s: float = 5.0) -> dict:
        sock = self.socks[address]
        assert sock.poll(int(timeout_s * 1000)), f"nothing arrived at {address}"
        return data_plane.unpack(sock.recv())


@pytest.fixture
def inboxes() -> Iterator[Inboxes]:
    boxes = Inboxes()
    yield boxes
    boxes.context.destroy(linger=0)


def submit(sched: GlobalScheduler, rid: str) -> str:
    """Admit ``rid`` and send it to its node; the node id."""
    req = NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=tuple(range(100, 140)),
                      sampling=SamplingParams(max_tokens=4))
    adm = sched.admit_and_submit(req, GATEWAY_INBOX, [])
    assert adm.code == "OK", adm
    return adm.node_id


def sockets(sched: GlobalScheduler) -> set[str]:
    """The addresses the scheduler holds a command socket to."""
    return set(sched.commands._socks)


def test_a_restarted_nodes_old_inbox_loses_its_socket(tmp_path: Path, inboxes: Inboxes) -> None:
    """Regression (review 23b F1): ``node_up`` replaced a restarted node's inbox but kept the
    PUSH socket to the old one, reconnecting to the dead process's port for ever with what it
    had queued: one more socket per restart (3 sockets for 2 nodes after 3 restarts of one).
    Now the socket to the old inbox is closed, and commands reach the new one."""
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4}), "t")
    first = inboxes.open()
    sched.attach_nodes({"n0": first})
    assert submit(sched, "r0") == "n0"
    assert inboxes.receive(first)["req"]["request_id"] == "r0"
    assert sockets(sched) == {first}
    live = first
    for restart in range(1, 4):
        inboxes.close(live)
        sched.node_down("n0", "its data-plane connection closed")
        sched.gateway_gone(f"tcp://127.0.0.1:{restart}")  # an abort queued for the dead process
        live = inboxes.open()
        sched.node_up("n0", live, pid=1000 + restart, restarts=restart)
        assert sockets(sched) == set(), "the dead inbox's socket is still open"
        assert submit(sched, f"r{restart}") == "n0"
        assert inboxes.receive(live)["req"]["request_id"] == f"r{restart}"
        assert sockets(sched) == {live}
    sched.commands.close()


def test_the_same_process_back_keeps_its_socket(tmp_path: Path, inboxes: Inboxes) -> None:
    """A node that only missed a poll comes back with the same inbox: its socket stays (and
    what it queued while the node was down is delivered)."""
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4}), "t")
    inbox = inboxes.open()
    sched.attach_nodes({"n0": inbox})
    sched.node_up("n0", inbox, pid=7, restarts=0)
    submit(sched, "r0")
    sched.node_down("n0", "did not answer within 15 s")
    sched.node_up("n0", inbox, pid=7, restarts=0)
    assert sockets(sched) == {inbox}
    assert inboxes.receive(inbox)["req"]["request_id"] == "r0"
    submit(sched, "r1")
    assert inboxes.receive(inbox)["req"]["request_id"] == "r1"
    sched.commands.close()


def test_attaching_nodes_again_keeps_the_sender_and_forgets_replaced_inboxes(
        tmp_path: Path, inboxes: Inboxes) -> None:
    """``attach_nodes`` again (same kind as F1): the sockets of inboxes no longer attached are
    closed and the sender is kept (a new one each time left the old one's context and sockets
    open)."""
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4, "n1": 4}), "t")
    a, b, c = inboxes.open(), inboxes.open(), inboxes.open()
    sched.attach_nodes({"n0": a, "n1": b})
    sender = sched.commands
    sched.gateway_gone("tcp://127.0.0.1:8")  # an abort to every node: a socket per inbox
    assert sockets(sched) == {a, b}
    sched.attach_nodes({"n0": a, "n1": c})
    assert sched.commands is sender
    assert sockets(sched) == {a}
    sched.commands.close()
