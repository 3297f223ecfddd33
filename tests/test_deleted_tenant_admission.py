"""secrev18 E: a deleted tenant's late requests are refused at admission, never open a session,
and no admission reads the tenant store (specs are kept current at start, register, update and
delete). Real ``GlobalScheduler`` / ``GlobalSchedulerService`` over a real store on disk.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from services.global_scheduler import GlobalScheduler
from services.global_scheduler_admission import GlobalSchedulerService
from services.global_scheduler_checks import REJECT_REASONS
from tenants.model import TenantSpec
from tests.known_tenants import Sender, no_store_reads


def test_a_deleted_tenants_late_request_is_refused_and_opens_no_session(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (secrev18 E): after delete_tenant (and its end_tenant to the nodes), a request
    of the tenant still in a gateway's pipeline was admitted (code OK on n0), recorded a session
    route nothing would close (sessions_per_tenant 1), and re-read every tenant from SQLite.
    Now it is UNAUTHENTICATED ("tenant_deleted"): nothing is routed or counted, no store read."""
    gs = GlobalScheduler(str(tmp_path), {"n0": 8})
    gs.attach_nodes({"n0": "tcp://127.0.0.1:9"}, Sender())
    for i in range(5):
        gs.register_tenant(TenantSpec(f"t{i}"))
    gone, key = gs.register_tenant(TenantSpec("gone"))
    assert gs.authenticate(key) == gone
    gs.delete_tenant("gone")
    no_store_reads(gs, monkeypatch)

    adm = gs.admit(gone.tenant_id, "gone/r1", session_id=f"{gone.tenant_id}/s1", prompt_tokens=10)

    assert (adm.code, adm.reason, adm.node_id) == ("UNAUTHENTICATED", "tenant_deleted", "")
    assert "tenant_deleted" in REJECT_REASONS
    assert gs.commands.sent == [{"op": "end_tenant", "tenant": gone.tenant_id}]
    assert f"{gone.tenant_id}/s1" not in gs.session_nodes and gs.sessions_per_tenant[gone.tenant_id] == 0
    assert gs.nodes["n0"].in_flight == set() and gs.requests == {}


def test_a_check_that_raced_the_delete_does_not_bring_its_spec_back(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A key check that read the tenant's row before the delete (``authenticate`` runs in a
    worker thread) answers after it: the tenant stays refused."""
    gs = GlobalScheduler(str(tmp_path), {"n0": 8})
    gone, key = gs.register_tenant(TenantSpec("gone"))
    gs.delete_tenant("gone")
    monkeypatch.setattr(gs.store, "authenticate", lambda *_a, **_k: gone)  # the row it read before

    assert gs.authenticate(key) == gone
    assert gone.tenant_id not in gs.specs
    assert gs.admit(gone.tenant_id, "gone/r1").code == "UNAUTHENTICATED"


def test_specs_are_current_without_a_key_check_or_a_store_read(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (secrev18 E): ``specs`` was filled by key checks alone, so an update reached
    admission only at the tenant's next check, and after a restart each admission of a tenant
    not checked yet re-read every tenant. Now register and update set it, and a restarted
    scheduler loads it once: a batch tenant made interactive is urgent at once, and after a
    restart its request is admitted with its class, with no store read."""
    gs = GlobalScheduler(str(tmp_path), {"n0": 8, "n1": 8}, scheduler="kvstrata")
    ann, _ = gs.register_tenant(TenantSpec("ann", "batch"))
    assert gs.admit(ann.tenant_id, "ann/r1").code == "OK" and not gs.nodes["n0"].urgent
    gs.update_tenant("ann", TenantSpec("ann", "interactive"))
    no_store_reads(gs, monkeypatch)

    assert gs.admit(ann.tenant_id, "ann/r2").code == "OK"
    assert {rid for n in gs.nodes.values() for rid in n.urgent} == {"ann/r2"}
    gs.store.close()

    restarted = GlobalScheduler(str(tmp_path), {"n0": 8, "n1": 8}, scheduler="kvstrata")
    no_store_reads(restarted, monkeypatch)
    assert restarted.admit(ann.tenant_id, "ann/r3").code == "OK"
    assert {rid for n in restarted.nodes.values() for rid in n.urgent} == {"ann/r3"}


def test_the_actors_tenant_writes_run_in_a_worker_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor's register, update and delete commit in a worker thread (not on the loop that
    answers admissions); the delete's end (refusal, routes, end_tenant) runs on the loop."""
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 4})
    scheduler.attach_nodes({"n0": "tcp://127.0.0.1:9"}, Sender())
    threads: list[tuple[str, int]] = []
    for name in ("register", "update", "delete"):
        real = getattr(scheduler.store, name)

        def traced(*args, _name=name, _real=real):  # type: ignore[no-untyped-def]
            threads.append((_name, threading.get_ident()))
            return _real(*args)

        monkeypatch.setattr(scheduler.store, name, traced)

    async def run() -> tuple[str, str]:
        ann, _ = await scheduler.register_tenant(TenantSpec("ann"))
        await scheduler.update_tenant("ann", TenantSpec("ann", "batch"))
        admitted = scheduler.admit(ann.tenant_id, "ann/r1", session_id=f"{ann.tenant_id}/s").code
        await scheduler.delete_tenant("ann")
        return admitted, scheduler.admit(ann.tenant_id, "ann/r2").code

    assert asyncio.run(run()) == ("OK", "UNAUTHENTICATED")
    assert [name for name, _ in threads] == ["register", "update", "delete"]
    assert all(ident != threading.get_ident() for _, ident in threads)
    assert scheduler.session_nodes == {} and scheduler.commands.sent[-1]["op"] == "end_tenant"
