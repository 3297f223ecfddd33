"""``peer_outbox.PeerOutbox`` against a peer that is alive but silent (its process stopped):
one call of a message is in flight at a time, however long the peer stays silent.

Regression (s40 review r3 of fc11c98): a call not answered within ``timeout_s`` (30 s) was sent
again, each time a new actor task queued at the peer while the one before still waited there.
A global scheduler stopped or deadlocked for an hour got ~120 ``sessions_ended`` calls from
each cache node, each holding every expiry untold so far (up to ``MAX_UNTOLD_SESSIONS`` ids, a
few MB), kept by Ray until the scheduler ran them all, stale, once it answered again (the
gateway sends a silent scheduler no such call for that reason: docs/architecture.md 'Scheduler
alive but silent'). Ray resolves a call's ref once its actor answers or dies, so the call
in flight is waited on, and only a failure sends it again.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import ray

from services.actor_refs import ActorRef, NamedPeer
from services.peer_outbox import PeerOutbox

NAMESPACE = "kvstrata-peer-outbox"


def _join(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    return {**newer, "session_ids": [*older["session_ids"], *newer["session_ids"]]}


def test_a_silent_peer_gets_one_call_of_a_message_not_one_per_timeout(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """The peer's process is stopped while ``note`` is told (0.2-s call timeout): once its
    call went unanswered 3 times a second message of the method is told (joined with the
    first, were it still untold). Once the process runs again, the peer ran the first call
    once and then the second: ``[("n0", ["s1"]), ("n0", ["s2"])]``. Before: the first call
    was sent again at each timeout and then joined with the second (9 calls ran)."""
    from tests.ray_actors import CountingPeer

    name = f"silent-peer-{os.getpid()}"
    peer = CountingPeer.options(name=name, namespace=NAMESPACE).remote()
    pid = ray.get(peer.pid.remote(), timeout=60)
    outbox = PeerOutbox(NamedPeer(ActorRef(name, NAMESPACE), relookup_s=0.0), timeout_s=0.2, retry_s=0.05)
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            outbox.tell("note", {"node_id": "n0", "session_ids": ["s1"]}, merge=_join)
            deadline = time.monotonic() + 30
            while outbox.counters.get("slow_calls", 0) + outbox.counters["failed_calls"] < 3:  # 3 timeouts
                assert time.monotonic() < deadline, outbox.counters
                time.sleep(0.05)
            outbox.tell("note", {"node_id": "n0", "session_ids": ["s2"]}, merge=_join)
            assert not outbox.flush(0.5)  # (silent: nothing answered yet)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert outbox.flush(30.0), outbox.counters
        assert ray.get(peer.noted.remote(), timeout=30) == [("n0", ["s1"]), ("n0", ["s2"])]
        assert outbox.counters["sent_calls"] == 2 and outbox.counters["slow_calls"] >= 1, outbox.counters
    finally:
        outbox.close()
        ray.kill(peer, no_restart=True)


def test_a_message_is_checked_once_a_peer_of_the_name_lives(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """``check`` runs after the name's look-up found a live actor, right before the call (s40
    review r3): while none lives nothing is sent, so it is not run (before: once per retry,
    every ``retry_s``, for as long as the peer was gone: a node's session lock taken each
    time). Once the peer is there the message is checked once and sent, by keyword."""
    from tests.ray_actors import CountingPeer

    name = f"late-peer-{os.getpid()}"
    checked: list[dict[str, Any]] = []

    def check(args: dict[str, Any]) -> dict[str, Any]:
        checked.append(args)
        return args

    outbox = PeerOutbox(NamedPeer(ActorRef(name, NAMESPACE), relookup_s=0.0), timeout_s=5.0, retry_s=0.05)
    peer = None
    try:
        outbox.tell("note", {"node_id": "n0", "session_ids": ["s1"]}, check=check)
        deadline = time.monotonic() + 30
        while outbox.counters["failed_calls"] < 3:  # three tries found no actor of the name
            assert time.monotonic() < deadline, outbox.counters
            time.sleep(0.05)
        assert checked == []
        peer = CountingPeer.options(name=name, namespace=NAMESPACE).remote()
        assert outbox.flush(60.0), outbox.counters
        assert ray.get(peer.noted.remote(), timeout=30) == [("n0", ["s1"])]
        assert checked == [{"node_id": "n0", "session_ids": ["s1"]}]
    finally:
        outbox.close()
        if peer is not None:
            ray.kill(peer, no_restart=True)


class _Flapping:
    """A ``NamedPeer`` whose look-ups find no live actor, or ``live``, in the order of ``plan``
    (True: ``live``); past its end, ``live``."""

    def __init__(self, live: Any, plan: list[bool]) -> None:
        self.live, self.plan = live, plan
        self.peer, self.missing = "flapping-peer", "no actor of the name"

    def handle(self) -> Any:
        return self.live if not self.plan or self.plan.pop(0) else None

    def forget(self, handle: Any) -> None:
        pass


def test_a_new_outage_is_logged_from_its_first_failed_call(ray_cluster, caplog) -> None:  # type: ignore[no-untyped-def]
    """The failed-call log (1st, 2nd, 4th, ... failure) counts from the peer's last answer (s40
    review r3): 4 failed calls (3 logged), an answer, then 1 failed call of a new outage, logged.
    Before, the count ran over the outbox's life: that 5th failure was not logged, nor any
    until the 8th, so a later outage's start went unseen."""
    from tests.ray_actors import CountingPeer

    peer = CountingPeer.remote()
    ray.get(peer.pid.remote(), timeout=60)
    looked_up = _Flapping(peer, [False] * 4 + [True, False])
    outbox = PeerOutbox(looked_up, timeout_s=5.0, retry_s=0.01)  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.WARNING, logger="services.peer_outbox"):
            outbox.tell("note", {"node_id": "n0", "session_ids": ["s1"]})
            assert outbox.flush(30.0), outbox.counters
            outbox.tell("note", {"node_id": "n0", "session_ids": ["s2"]})
            assert outbox.flush(30.0), outbox.counters
        assert outbox.counters["failed_calls"] == 5 and outbox.counters["sent_calls"] == 2, outbox.counters
        logged = [r.getMessage() for r in caplog.records if "not answered (sent again" in r.getMessage()]
        assert [m.split("; ")[1].split(" ")[0] for m in logged] == ["1", "2", "4", "1"], logged
    finally:
        outbox.close()
        ray.kill(peer, no_restart=True)
