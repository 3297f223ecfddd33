"""The gateway takes the global scheduler's Ray replies as untrusted (``services.scheduler_replies``):
a reply of another shape than its method's (a version skew, a bug) fails that call INTERNAL,
naming the method, and leaves the gateway serving the next call.

Regression (s38): the replies were used as they came. ``Stats`` read ``sched["queued"]`` (a
missing key, 2**32, a string: UNKNOWN); ``CloseSession`` unpacked ``close_session``'s reply (UNKNOWN,
or freed 0 for a session it never asked a node about, or the node sent a string for its turns);
tenant records and usage were converted as they came (UNKNOWN), a rotated key or a registered
tenant's key of ``None`` answered OK with an empty key; and ``verify_admin_key``'s reply was taken
by its truth: a reply of ``"no"`` let a tenant's own key list every tenant.

A real ``GlobalSchedulerService`` (its store on disk) behind ``_Skewed``, which runs each call
there and replaces one method's reply; the real ``Authenticator`` and servicers.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvstrata.v1 import admin_pb2, inference_pb2, tenant_pb2
from services.auth import Authenticator
from services.gateway import InferenceServicer
from services.gateway_admin import AdminServicer, TenantServicer
from services.gateway_inputs import session_scope
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.model import Tenant, TenantSpec
from tests.gateway_harness import NODE_INFO, LocalActor
from tests.grpc_context import GrpcContext, Refused


class _Skewed:
    """``LocalActor(scheduler)`` whose method ``method`` runs there and answers ``reply``
    instead of its own (what a scheduler of another version, or with a bug, sends)."""

    def __init__(self, scheduler: GlobalSchedulerService, method: str = "", reply: Any = None) -> None:
        self.scheduler, self.method, self.reply = scheduler, method, reply

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.scheduler, name)
        if name != self.method:
            return LocalActor(self.scheduler).__getattr__(name)

        async def skewed(*args: Any, **kwargs: Any) -> Any:
            answer = real(*args, **kwargs)
            if asyncio.iscoroutine(answer):
                await answer
            return self.reply

        return LocalActor(type("_", (), {"m": staticmethod(skewed)})).m


async def _outcome(call: Any) -> tuple[str, str]:
    """("OK", "") for a call that answered, else its status's name and message; an exception
    other than ``Refused`` (what gRPC sends as UNKNOWN) as ("raised", its type and text)."""
    try:
        await call
    except Refused as refused:
        return refused.code.name, refused.message
    except Exception as exc:  # noqa: BLE001 - what the regression was
        return "raised", f"{type(exc).__name__}: {exc}"
    return "OK", ""


def _with_scheduler(tmp_path: Path, body: Any) -> Any:
    async def run() -> Any:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 4})
        try:
            return await body(scheduler)
        finally:
            scheduler.store.close()

    return asyncio.run(run())


STATS_LIES = ({"sessions": 0}, {"queued": 1 << 32, "sessions": 0}, {"queued": "3", "sessions": 0},
              {"queued": 0, "sessions": 0, "x": b"\x00"}, [0, 0])


def test_stats_refuses_a_malformed_scheduler_stats_reply(tmp_path: Path) -> None:
    """Each lie: INTERNAL naming ``stats``; then a true reply answers. Before: KeyError,
    ValueError (out of range), TypeError (a str; bytes in JSON; list indices): UNKNOWN."""

    async def body(scheduler: GlobalSchedulerService) -> list[tuple[str, str]]:
        admin_key = scheduler.store.ensure_admin_key()
        outcomes = []
        for lie in (*STATS_LIES, None):
            handle = _Skewed(scheduler, "stats" if lie is not None else "", lie)
            servicer = AdminServicer(handle, Authenticator(handle), {}, node_timeout_s=5.0)
            outcomes.append(await _outcome(servicer.Stats(admin_pb2.StatsRequest(), GrpcContext(admin_key))))
        return outcomes

    outcomes = _with_scheduler(tmp_path, body)
    assert [code for code, _ in outcomes] == ["INTERNAL"] * len(STATS_LIES) + ["OK"], outcomes
    assert all("the global scheduler sent a malformed stats reply" in m for _, m in outcomes[:-1]), outcomes


class _Node:
    """A cache node's handle whose ``close_session`` answers 12 and records the turns it was sent."""

    def __init__(self) -> None:
        self.turns: list[Any] = []
        self.close_session = LocalActor(self).answer_close

    def answer_close(self, session_id: str, tenant: str, turns: Any = ()) -> int:  # the node's signature
        self.turns.append(turns)
        return 12


CLOSE_LIES = (("n0",), "n0", ("n0", "r1"), (7, []), {"n0": []})


def test_close_session_refuses_a_malformed_scheduler_reply(tmp_path: Path) -> None:
    """Each lie (the scheduler dropped a real session, then answered it): INTERNAL naming
    ``close_session``, the node never asked; then a true reply closes a session, 12 tokens.
    Before: ValueError / KeyError (UNKNOWN), freed 0 answered OK (``"n0"``: node "n", turns
    "0"; ``7``), the node sent the string "r1" as its turns (answered 12)."""

    async def body(scheduler: GlobalSchedulerService) -> tuple[list[tuple[str, str]], list[Any], str]:
        tenant, key = await scheduler.register_tenant(TenantSpec("ann"))
        node, outcomes = _Node(), []
        for i, lie in enumerate((*CLOSE_LIES, None)):
            session = session_scope(tenant.tenant_id, "", f"s{i}")
            assert scheduler.admit(tenant.tenant_id, f"{tenant.tenant_id}/r{i}", session_id=session).code == "OK"
            handle = _Skewed(scheduler, "close_session" if lie is not None else "", lie)
            servicer = InferenceServicer(handle, Authenticator(handle), {"n0": node}, {"n0": NODE_INFO},
                                         None, "tcp://127.0.0.1:9")
            outcomes.append(await _outcome(servicer.CloseSession(
                inference_pb2.CloseSessionRequest(session_id=f"s{i}"), GrpcContext(key))))
        return outcomes, node.turns, tenant.tenant_id

    outcomes, turns, tenant_id = _with_scheduler(tmp_path, body)
    assert [code for code, _ in outcomes] == ["INTERNAL"] * len(CLOSE_LIES) + ["OK"], outcomes
    assert all("malformed close_session reply" in m for _, m in outcomes[:-1]), outcomes
    assert turns == [[f"{tenant_id}/r{len(CLOSE_LIES)}"]], turns  # the true reply's turn alone


def _unpickled(tenant_id: Any, spec: Any, created_at_s: Any) -> Tenant:
    """A ``Tenant`` as unpickling makes it (Ray's reply): its fields set, ``__post_init__``'s checks not run."""
    record = object.__new__(Tenant)
    for name, value in (("tenant_id", tenant_id), ("spec", spec), ("created_at_s", created_at_s)):
        object.__setattr__(record, name, value)
    return record


SPEC = TenantSpec("ann")
TENANT_LIES = (
    ("get_tenant", {"tenant_id": "t"}, "GetTenant"), ("get_tenant", _unpickled(5, SPEC, 0.0), "GetTenant"),
    ("get_tenant", _unpickled("t", "ann", 0.0), "GetTenant"), ("list_tenants", None, "ListTenants"),
    ("usage_of", {"prompt_tokens": 1}, "GetUsage"), ("register_tenant", (Tenant("t", SPEC, 0.0),), "RegisterTenant"),
    ("register_tenant", (Tenant("t", SPEC, 0.0), None), "RegisterTenant"), ("rotate_tenant_key", None, "RotateKey"),
    ("update_tenant", "ann", "UpdateTenant"), ("delete_tenant", None, "DeleteTenant"),
)


def _tenant_request(handler: str, i: int) -> Any:
    if handler == "RegisterTenant":  # (each registers a tenant of its own)
        return tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name=f"bob{i}"))
    if handler == "UpdateTenant":
        return tenant_pb2.UpdateTenantRequest(name="ann", spec=tenant_pb2.TenantSpec(name="ann"))
    if handler == "ListTenants":
        return tenant_pb2.ListTenantsRequest()
    return getattr(tenant_pb2, f"{handler}Request")(name="ann")


TRUE_CALLS = ("GetTenant", "ListTenants", "GetUsage", "RegisterTenant", "RotateKey", "UpdateTenant", "DeleteTenant")


def test_tenant_calls_refuse_malformed_tenant_records_and_keys(tmp_path: Path) -> None:
    """Each (method, lie, handler), with the admin key: INTERNAL naming the method; then each
    handler with the scheduler's true replies answers OK (no true reply is refused). Before:
    AttributeError / TypeError / ValueError (UNKNOWN) for the records and the usage, and OK with
    an empty key for a register or a rotation whose key was None, OK for a delete of no id."""

    async def body(scheduler: GlobalSchedulerService) -> list[tuple[str, str]]:
        admin_key = scheduler.store.ensure_admin_key()
        outcomes = []
        for i, (method, lie, handler) in enumerate((*TENANT_LIES, *(("", None, h) for h in TRUE_CALLS))):
            if not any(t.spec.name == "ann" for t in scheduler.list_tenants()):  # (deleted by the last)
                await scheduler.register_tenant(SPEC)
            handle = _Skewed(scheduler, method, lie)
            servicer = TenantServicer(handle, Authenticator(handle), {}, node_timeout_s=5.0)
            call = getattr(servicer, handler)(_tenant_request(handler, i), GrpcContext(admin_key))
            outcomes.append(await _outcome(call))
        return outcomes

    outcomes = _with_scheduler(tmp_path, body)
    for (method, lie, _), (code, message) in zip(TENANT_LIES, outcomes[:len(TENANT_LIES)], strict=True):
        assert (code, f"malformed {method} reply" in message) == ("INTERNAL", True), (method, lie, code, message)
    assert outcomes[len(TENANT_LIES):] == [("OK", "")] * len(TRUE_CALLS), outcomes[len(TENANT_LIES):]


def test_a_truthy_admin_verdict_is_no_admin(tmp_path: Path) -> None:
    """``verify_admin_key`` answering ``"no"`` (truthy, not a bool): a tenant's own key listing
    the tenants is INTERNAL, and so is the admin key's call; ``authenticate`` answering a map
    in place of a record: the tenant's GetTenant is INTERNAL. Before: the tenant's key was taken
    for the admin key and listed every tenant (OK); the map failed AttributeError (UNKNOWN)."""

    async def body(scheduler: GlobalSchedulerService) -> list[tuple[str, str]]:
        admin_key = scheduler.store.ensure_admin_key()
        await scheduler.register_tenant(TenantSpec("bob"))
        _ann, key = await scheduler.register_tenant(SPEC)
        skewed = _Skewed(scheduler, "verify_admin_key", "no")
        lists = TenantServicer(skewed, Authenticator(skewed), {}, node_timeout_s=5.0).ListTenants
        mapped = _Skewed(scheduler, "authenticate", {"tenant_id": "t"})
        gets = TenantServicer(mapped, Authenticator(mapped), {}, node_timeout_s=5.0).GetTenant
        return [await _outcome(lists(tenant_pb2.ListTenantsRequest(), GrpcContext(key))),
                await _outcome(lists(tenant_pb2.ListTenantsRequest(), GrpcContext(admin_key))),
                await _outcome(gets(tenant_pb2.GetTenantRequest(name="ann"), GrpcContext(key)))]

    outcomes = _with_scheduler(tmp_path, body)
    assert [code for code, _ in outcomes] == ["INTERNAL"] * 3, outcomes
    assert "malformed verify_admin_key reply" in outcomes[0][1], outcomes
    assert "malformed authenticate reply" in outcomes[2][1], outcomes


def test_a_well_formed_reply_passes_the_checks() -> None:
    """The checks take what the scheduler's methods return (``close_session``'s tuple and its
    None, a node id of None for none to ask), so no true reply is refused."""
    from services import scheduler_replies as replies

    assert replies.closing("close_session", ("n0", ["a/r1#x"])) == ("n0", ["a/r1#x"])
    assert replies.closing("close_session", (None, [])) == ("", [])
    assert replies.closing("close_session", None) is None
    assert replies.verdict("verify_admin_key", False) is False


ADDRESS_LIES = ({"grpc": "127.0.0.1:50051"}, {"grpc": "127.0.0.1:x", "http": "", "metrics": ""},
                {"grpc": 50051, "http": "", "metrics": ""}, ["127.0.0.1:50051"])


def test_a_restarted_gateway_takes_a_malformed_scheduler_record_for_none(monkeypatch: Any) -> None:
    """``RayGateway._start_again`` with the scheduler's ``gateway_addresses`` answering each lie:
    the gateway serves again on its own record (``ServedRecord``). Before: every try raised
    (KeyError 'http', ValueError from ``int('x')``, AttributeError, TypeError), and after its
    tries the gateway exited for Ray to restart it into the same lie."""
    from services.gateway_served import ServedRecord
    from services.gateway_server import RayGateway
    from tests.gateway_harness import ClusterKeyValues

    own = {"grpc": "127.0.0.1:7001", "http": "127.0.0.1:7002", "metrics": ""}
    store = ClusterKeyValues()
    asyncio.run(ServedRecord("gw", store).save(own))
    served: list[Any] = []

    async def serve(host: str, port: int, http_port: int | None, metrics_port: int | None) -> int:
        served.append((host, port, http_port, metrics_port))
        return port

    async def start_again(lie: Any) -> tuple[str, str]:
        gateway = RayGateway.__new__(RayGateway)
        gateway.gateway_id, gateway.served_record, gateway._serve = "gw", ServedRecord("gw", store), serve
        gateway.scheduler_calls = LocalActor(type("_", (), {"gateway_addresses": staticmethod(lambda gateway_id: lie)}))
        return await _outcome(gateway._start_again(old_api_ports=True))

    outcomes = [asyncio.run(start_again(lie)) for lie in ADDRESS_LIES]
    assert outcomes == [("OK", "")] * len(ADDRESS_LIES), outcomes
    assert served == [("127.0.0.1", 7001, 7002, None)] * len(ADDRESS_LIES)
