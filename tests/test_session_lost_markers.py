"""Sessions lost with a restarted cache node (``GlobalScheduler.lost_sessions``): each tenant's
are bounded by its ``max_sessions_per_tenant``, never dropped for another tenant's, and a
lost session's next turn never runs without its history."""

from __future__ import annotations

from services.global_scheduler import GlobalScheduler
from tenants.model import TenantSpec
from tests.known_tenants import know_tenants

FINISHED = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}


def open_sessions(sched: GlobalScheduler, tenant_id: str, n: int) -> list[str]:
    ids = [f"{tenant_id}/s{k}" for k in range(n)]
    for k, sid in enumerate(ids):
        assert sched.admit(tenant_id, f"{tenant_id}/r{k}", session_id=sid).code == "OK"
        sched.release(f"{tenant_id}/r{k}", FINISHED)
    return ids


def test_another_tenants_lost_sessions_never_push_out_a_tenants_marker(tmp_path) -> None:
    """Regression (security review F6): the markers of lost sessions were capped at 65,536 for
    all tenants together, oldest dropped: a tenant's session lost in the same restart as
    65,536 of another tenant's had its marker dropped, and its next turn ran as a new session,
    silently without its history."""
    sched = GlobalScheduler(str(tmp_path), {"n0": 8}, max_sessions_per_tenant=70_000)
    victim, other = (sched.register_tenant(TenantSpec(name, "standard"))[0].tenant_id for name in ("victim", "other"))
    (mine,) = open_sessions(sched, victim, 1)
    open_sessions(sched, other, 65_536)
    sched.node_down("n0", "its data-plane connection closed")
    sched.node_up("n0", "inbox2", pid=0)  # a new process: every history there is gone
    lost = sched.admit(victim, "next-turn", session_id=mine)
    assert (lost.code, lost.reason) == ("ABORTED", "session_lost")


def test_a_tenants_lost_sessions_count_as_its_sessions_until_closed_or_their_ttl(tmp_path) -> None:
    """A tenant's lost sessions take places of its ``max_sessions_per_tenant`` (its markers
    are bounded by it and none is dropped): a new session is refused until one is closed;
    another tenant's count is its own. A marker is forgotten ``session_ttl_s`` after the
    loss, when the session would have expired on its node too."""
    now = [100.0]
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 8}, max_sessions_per_tenant=2, session_ttl_s=900.0,
                                         clock=lambda: now[0]), "a", "b")
    a1, a2 = open_sessions(sched, "a", 2)
    (b1,) = open_sessions(sched, "b", 1)
    sched.node_down("n0", "restarting")
    sched.node_up("n0", "inbox2", pid=0)
    for sid in (a1, a2):
        assert sched.admit("a", "a/again", session_id=sid).reason == "session_lost"
    full = sched.admit("a", "a/new", session_id="a/new")
    assert (full.code, full.reason) == ("RESOURCE_EXHAUSTED", "too_many_sessions")
    assert "2 of them lost" in full.message and "CloseSession" in full.message
    assert sched.admit("a", "a/plain").code == "OK"  # requests without a session go on
    assert sched.admit("b", "b/new", session_id="b/new").code == "OK"  # b: 1 lost + 1 open
    assert sched.close_session(a1, "a") == ("", [])
    assert sched.admit("a", "a/new2", session_id="a/new").code == "OK"
    assert sched.admit("a", "a/again2", session_id=a2).reason == "session_lost"  # still refused

    now[0] += 900.0  # idle that long, it would have expired on its node: opened anew
    assert sched.admit("b", "b/after", session_id=b1).code == "OK"
    assert not sched.lost_of("a") and not sched.lost_sessions.get("b")


def test_the_launcher_gives_the_scheduler_the_nodes_session_ttl(tmp_path) -> None:
    """Regression: the launcher did not pass ``session_ttl_s``, so lost-session markers lasted
    900 s whatever the nodes' TTL."""
    from services.config import ServiceConfig
    from services.launcher import session_limits

    config = ServiceConfig(session_ttl_s=60.0, max_sessions_per_tenant=3)
    now = [0.0]
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 8}, clock=lambda: now[0], **session_limits(config)), "a")
    assert (sched.session_ttl_s, sched.max_sessions_per_tenant) == (60.0, 3)
    (sid,) = open_sessions(sched, "a", 1)
    sched.node_down("n0", "restarting")
    sched.node_up("n0", "inbox2", pid=0)
    assert sched.admit("a", "a/again", session_id=sid).reason == "session_lost"
    now[0] += 61.0  # the nodes' TTL, not 900 s
    assert sched.admit("a", "a/after", session_id=sid).code == "OK"


def test_a_restarted_scheduler_still_refuses_a_lost_sessions_turn(tmp_path, monkeypatch) -> None:
    """Regression: the lost-session marks lived only in the scheduler's memory. After a crash
    of the scheduler (Ray restarts it) a session whose node had restarted was unknown, and its
    next turn opened it anew and ran without its history, silently. Now the marks are stored
    (``flush_sessions``, every USAGE_FLUSH_S and at stop) and a new scheduler on the same
    state dir refuses the turn, until the session is closed or its TTL passed since the loss."""
    import services.global_scheduler_sessions as sessions

    wall = [1_000_000.0]
    monkeypatch.setattr(sessions.time, "time", lambda: wall[0])
    first = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=900.0)
    ann = first.register_tenant(TenantSpec("ann", "standard"))[0].tenant_id
    gone = first.register_tenant(TenantSpec("gone", "standard"))[0].tenant_id
    lost, closed = open_sessions(first, ann, 2)
    open_sessions(first, gone, 1)
    first.node_down("n0", "restarting")
    first.node_up("n0", "inbox2", pid=0)  # a new process: the three histories are gone
    assert first.close_session(closed, ann) == ("", [])  # closed by its client: no longer lost
    # 2 marks: the routes (opened, then dropped at the node's restart) and the closed
    # session's mark were never stored, so nothing of them is (review 26e F4)
    assert first.flush_sessions() == 2 and first.flush_sessions() == 0
    first.delete_tenant("gone")  # its marks go with it
    first.store.close()

    wall[0] += 600.0  # the scheduler crashed and came back 10 minutes later
    second = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=900.0)
    refused = second.admit(ann, "next-turn", session_id=lost)
    assert (refused.code, refused.reason) == ("ABORTED", "session_lost")  # before: OK, no history
    assert second.admit(ann, "reopened", session_id=closed).code == "OK"
    assert set(second.lost_sessions) == {ann}
    second.store.close()

    wall[0] += 301.0  # 901 s after the loss: it would have expired on its node too
    third = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=900.0)
    assert not third.lost_sessions and third.admit(ann, "late", session_id=lost).code == "OK"
