"""``actor_refs.NamedPeer.handle`` never raises: a look-up that fails for another reason than
"no live actor of that name" keeps the last handle.

Regression (s39 review r1): only Ray's ValueError (no such actor) was caught, so a failed look-up
(the GCS slow or unreachable: Ray raises ``GetTimeoutError``, ``RpcError``, ...) raised out of
``handle()``: a cache node's step thread, telling the scheduler of expired sessions
(``CacheNodeActor._sessions_ended``), failed the node for it, and its constructor raised.

``ray.get_actor`` is replaced here by a stand-in that answers a handle, "no such actor" or a
GCS failure on cue: a GCS that times out cannot be had for real on a shared host without
stopping a Ray cluster's GCS; Ray's own exception classes are raised.
"""

from __future__ import annotations

from typing import Any

import pytest
import ray
from ray.exceptions import GetTimeoutError, RpcError

from services.actor_refs import ActorRef, NamedPeer


class _Gcs:
    """``ray.get_actor`` answering from ``answers`` in turn (an exception is raised)."""

    def __init__(self, *answers: Any) -> None:
        self.answers, self.asked = list(answers), 0

    def __call__(self, name: str, namespace: str | None = None) -> Any:
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_look_up_keeps_the_handle_found_before(monkeypatch: pytest.MonkeyPatch) -> None:
    handle = object()
    gcs = _Gcs(handle, GetTimeoutError("Timed out while waiting for GCS"), RpcError("GCS unavailable"))
    monkeypatch.setattr(ray, "get_actor", gcs)
    clock = _Clock()
    peer = NamedPeer(ActorRef("scheduler", "ns"), relookup_s=5.0, clock=clock)
    assert peer.handle() is handle and peer.missing == ""
    clock.now += 5.0
    assert peer.handle() is handle and peer.missing == ""  # (the GCS timed out: no answer)
    clock.now += 5.0
    assert peer.handle() is handle and peer.missing == ""
    assert gcs.asked == 3


def test_a_failed_look_up_before_any_handle_is_none_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    handle = object()
    gcs = _Gcs(GetTimeoutError("Timed out while waiting for GCS"),
               ValueError("Failed to look up actor with name 'scheduler'"), handle)
    monkeypatch.setattr(ray, "get_actor", gcs)
    clock = _Clock()
    peer = NamedPeer(ActorRef("scheduler", "ns"), relookup_s=5.0, clock=clock)
    assert peer.handle() is None
    assert peer.missing.startswith("looking up scheduler failed") and "GetTimeoutError" in peer.missing, peer.missing
    assert peer.handle() is None and gcs.asked == 1  # (looked up again only after relookup_s)
    clock.now += 5.0
    assert peer.handle() is None and peer.missing.startswith("no live actor named scheduler"), peer.missing
    clock.now += 5.0
    assert peer.handle() is handle and peer.missing == ""


def test_missing_now_never_waits_for_a_look_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's ``stats`` (on its event loop) reads ``missing_now``: a look-up hung on the GCS
    runs on a background thread, the answer shows in a later call (s39 review r1: ``stats``
    called ``handle()`` and waited for the GCS)."""
    import threading
    import time

    release, entered = threading.Event(), threading.Event()

    def hung_gcs(name: str, namespace: str | None = None) -> Any:
        entered.set()
        release.wait(10)
        raise ValueError("Failed to look up actor with name 'scheduler'")

    monkeypatch.setattr(ray, "get_actor", hung_gcs)
    peer = NamedPeer(ActorRef("scheduler", "ns"), relookup_s=5.0)
    started = time.monotonic()
    assert peer.missing_now() == ""  # (nothing looked up yet: no answer to give)
    assert entered.wait(5)
    assert peer.missing_now() == ""  # (the look-up still hangs: one at a time, none waited for)
    assert time.monotonic() - started < 1.0
    release.set()
    deadline = time.monotonic() + 5
    while not peer.missing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert peer.missing_now().startswith("no live actor named scheduler"), peer.missing
