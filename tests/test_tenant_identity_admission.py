"""secrev18 E residue: the scheduler admits (closes sessions of, reports usage of) only tenants
of its store, and remembers deleted tenants across a restart. An id the store does not hold
reaches it only from a gateway's stale key cache or a forged or buggy caller. Real
``GlobalScheduler`` / ``GlobalSchedulerService`` over a real store on disk.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.global_scheduler import GlobalScheduler
from services.global_scheduler_admission import GlobalSchedulerService
from services.global_scheduler_checks import REJECT_REASONS
from services.node_request import NodeRequest
from tenants import store as store_module
from tenants.errors import TenantNotFoundError
from tenants.model import TenantSpec
from tenants.store import TenantStore
from tests.known_tenants import Sender, no_store_reads

FINISHED = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}


def test_an_id_that_is_no_tenants_is_refused_and_touches_nothing(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (secrev18 E residue): a request of an id the store never held (a forged or
    buggy caller) was admitted with the default class (code OK on n0): it ran, opened a session
    route, took a routing key and a usage entry. Now it is UNAUTHENTICATED ("unknown_tenant"),
    without a store read, and nothing of any tenant changes."""
    gs = GlobalScheduler(str(tmp_path), {"n0": 8, "n1": 8})
    ann, _ = gs.register_tenant(TenantSpec("ann"))
    assert gs.admit(ann.tenant_id, "ann/r1", session_id="ann/s", routing_key="k").code == "OK"
    def state() -> tuple:
        return (dict(gs.session_nodes), dict(gs.requests), dict(gs.routing_keys.by_tenant), gs.usage.snapshot_all(),
                {nid: (set(n.in_flight), dict(n.backlog.by_rank)) for nid, n in gs.nodes.items()})

    before = state()
    no_store_reads(gs, monkeypatch)

    forged = gs.admit("forged", "forged/r1", session_id="forged/s", prompt_tokens=10, routing_key="k")
    hijack = gs.admit("forged", "forged/r2", session_id="ann/s")

    assert (forged.code, forged.reason, forged.node_id) == ("UNAUTHENTICATED", "unknown_tenant", "")
    assert (hijack.code, hijack.reason) == ("UNAUTHENTICATED", "unknown_tenant")
    assert "unknown_tenant" in REJECT_REASONS
    assert state() == before and "forged" not in gs.sessions_per_tenant
    assert before[4] == {"n0": ({"ann/r1"}, {}), "n1": (set(), {})}  # no uncached tokens queued


def test_a_tenant_deleted_before_a_restart_stays_refused_as_deleted(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (secrev18 E residue): deletions lived in memory alone, so after a scheduler
    restart a deleted tenant's late request (its key still in a gateway's cache) was admitted
    with the default class. The store keeps deleted ids: a restarted scheduler refuses it
    UNAUTHENTICATED with "tenant_deleted", reading the store only at start."""
    gs = GlobalScheduler(str(tmp_path), {"n0": 8})
    gone, _ = gs.register_tenant(TenantSpec("gone"))
    ann, _ = gs.register_tenant(TenantSpec("ann"))
    gs.delete_tenant("gone")
    gs.store.close()

    restarted = GlobalScheduler(str(tmp_path), {"n0": 8})
    no_store_reads(restarted, monkeypatch)
    adm = restarted.admit(gone.tenant_id, "gone/r1", session_id="gone/s")

    assert (adm.code, adm.reason) == ("UNAUTHENTICATED", "tenant_deleted")
    assert list(restarted.deleted_tenants) == [gone.tenant_id] and set(restarted.specs) == {ann.tenant_id}
    assert restarted.session_nodes == {} and restarted.requests == {}
    assert restarted.admit(ann.tenant_id, "ann/r1").code == "OK"


def test_the_store_keeps_the_newest_deleted_ids_across_a_reopen(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The store keeps the last ``MAX_DELETED_TENANTS`` deleted ids, oldest first, through a
    reopen; a delete commits the tenant's removal and its id together."""
    monkeypatch.setattr(store_module, "MAX_DELETED_TENANTS", 3)
    store = TenantStore(tmp_path / "tenants.sqlite")
    ids = [store.register(TenantSpec(f"t{i}"))[0].tenant_id for i in range(5)]
    assert [store.delete(f"t{i}") for i in range(5)] == ids
    store.close()

    reopened = TenantStore(tmp_path / "tenants.sqlite")
    assert reopened.deleted_tenant_ids() == tuple(ids[2:])
    assert reopened.list() == ()
    with pytest.raises(TenantNotFoundError):
        reopened.delete("t0")
    assert reopened.deleted_tenant_ids() == tuple(ids[2:])


def test_close_session_and_usage_of_answer_tenants_alone(tmp_path: Path) -> None:
    """Regression (secrev18 E residue): a deleted tenant's sessions lost with a restarted node
    stayed marked (its close answered ("", []) as a tenant's), and ``usage_of`` answered
    zeros for any id. A close for an id that is no tenant's answers None (NOT_FOUND), and
    ``usage_of`` raises TenantNotFoundError for one."""
    gs = GlobalScheduler(str(tmp_path), {"n0": 8})
    gone, _ = gs.register_tenant(TenantSpec("gone"))
    assert gs.admit(gone.tenant_id, "gone/r1", session_id="gone/s").code == "OK"
    gs.release("gone/r1", FINISHED)
    gs.node_down("n0", "restarting")
    gs.node_up("n0", "inbox2", pid=0)  # a new process: the session is lost
    assert gs.lost_of(gone.tenant_id) != {}
    gs.delete_tenant("gone")

    assert gs.lost_sessions == {}
    assert gs.close_session("gone/s", gone.tenant_id) is None
    assert gs.close_session("any", "forged") is None
    with pytest.raises(TenantNotFoundError):
        gs.usage_of(gone.tenant_id)
    with pytest.raises(TenantNotFoundError):
        gs.usage_of("forged")


def test_a_deleted_tenants_bookkeeping_goes_and_a_late_release_counts_nothing(tmp_path: Path) -> None:
    """Regression (secrev18 E residue): a deleted tenant's routing keys and usage counters
    stayed, and the release of its request still in flight at the delete counted its tokens
    again under its id. Another tenant's stay as they were."""
    gs = GlobalScheduler(str(tmp_path), {"n0": 8})
    gone, _ = gs.register_tenant(TenantSpec("gone"))
    ann, _ = gs.register_tenant(TenantSpec("ann"))
    for tenant in (gone, ann):
        assert gs.admit(tenant.tenant_id, f"{tenant.name}/r1", routing_key="k").code == "OK"
    gs.delete_tenant("gone")
    gs.release("gone/r1", FINISHED)
    gs.release("ann/r1", FINISHED)

    assert list(gs.routing_keys.by_tenant) == [ann.tenant_id] and len(gs.routing_keys) == 1
    assert list(gs.usage.snapshot_all()) == [ann.tenant_id]
    assert gs.usage_of(ann.tenant_id).completion_tokens == 8 and gs.requests == {}


def test_the_actor_refuses_an_unknown_tenants_admission_message_on_the_wire(tmp_path: Path) -> None:
    """An admission message naming an id that is no tenant's (what a gateway with a stale key
    cache, or a buggy one, sends) gets a reply the gateway accepts (``admission_reply``: the
    reason is one of ``REJECT_REASONS``), UNAUTHENTICATED "unknown_tenant", and no node hears
    of it; a registered tenant's goes on to its node."""
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 4})
    scheduler.attach_nodes({"n0": "tcp://127.0.0.1:9"}, Sender())
    ann, _ = asyncio.run(scheduler.register_tenant(TenantSpec("ann")))

    def message(corr: int, tenant: str) -> bytes:
        req = NodeRequest(request_id=f"{tenant}/r", tenant=tenant, cache_namespace="ns", token_ids=(1, 2, 3),
                          sampling=SamplingParams(max_tokens=2))
        return data_plane.pack({"id": corr, "req": data_plane.request_to_wire(req), "sub": "tcp://127.0.0.1:8",
                                "hashes": []})

    corr, adm = data_plane.admission_reply(scheduler._answer(message(1, "forged")), {"n0"})
    assert corr == 1 and (adm["code"], adm["reason"], adm["node_id"]) == ("UNAUTHENTICATED", "unknown_tenant", "")
    assert scheduler.commands.sent == [] and scheduler.bad_messages == 0

    corr, adm = data_plane.admission_reply(scheduler._answer(message(2, ann.tenant_id)), {"n0"})
    assert (corr, adm["code"], adm["node_id"]) == (2, "OK", "n0")
    assert [m["op"] for m in scheduler.commands.sent] == ["submit"]


def test_a_failed_admissions_error_text_is_cut_to_what_the_gateway_reads(tmp_path: Path, monkeypatch) -> None:
    """An exception text of any length (here 2 MiB) comes back cut, in a reply the gateway's
    decode limits and ``admission_reply`` take: before, a reply past ``REPLY_LIMITS`` was
    refused whole and its admission waited out its timeout (review 25a, follow-up of B)."""
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 4})
    scheduler.attach_nodes({"n0": "tcp://127.0.0.1:9"}, Sender())
    ann, _ = asyncio.run(scheduler.register_tenant(TenantSpec("ann")))

    def fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("x" * (2 << 20))

    monkeypatch.setattr(scheduler, "admit_and_submit", fails)
    req = NodeRequest(request_id=f"{ann.tenant_id}/r", tenant=ann.tenant_id, cache_namespace="ns",
                      token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=2))
    reply = scheduler._answer(data_plane.pack({"id": 7, "req": data_plane.request_to_wire(req),
                                               "sub": "tcp://127.0.0.1:8", "hashes": []}))
    wire = data_plane.pack(reply)
    corr, error = data_plane.admission_reply(data_plane.unpack(wire, data_plane.REPLY_LIMITS), {"n0"})
    assert corr == 7 and len(error) <= data_plane.MAX_TEXT_CHARS
    # the exception text stays in the scheduler's log (review s35 C S1): an error id reaches the tenant
    assert "error id" in error and "xxx" not in error
