"""A churn of tenants registered, served and deleted leaves no per-tenant state behind (s37).

On the real stack of ``test_logprobs_served`` with the production scheduling policy
(``kvstrata``): each churned tenant (interactive, with a token-rate floor, so every counter of
the policy is charged) runs a gRPC session turn and HTTP requests (a salted session turn with a
``prompt_cache_key``, an ``n`` = 2 body) through the gateway and is deleted by the gateway's
``TenantService.DeleteTenant`` (the scheduler's ``delete_tenant``, whose ``end_tenant`` reaches
the node, and the gateway's own forgetting). Afterwards every per-tenant structure of the
node's scheduler and tiers, and the scheduler's and the gateway's, holds what it held before
the churn, and no dict or set reachable from the node, the scheduler or the gateway is keyed
by a deleted tenant's id or name but the two bounded memories of deleted ids (``DELETED_MEMORIES``).

Fault: the node's policy kept each deleted tenant's share, VTC counter and token-rate window
(``cache_node.scheduling.fair_share``), its scheduler a zero count per tenant ever seen, and its
tiers' holder weights the tenant's entry: one entry each per tenant ever served, bounded only by
the tenants ever registered. On 94cc53d each grew by the churned tenants.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvstrata.v1 import inference_pb2, tenant_pb2, tenant_pb2_grpc
from tenants.model import TenantSpec
from tests.loop_plane import call, wait_for
from tests.test_logprobs_served import PROMPT, Served

CHURNED = 5
DELETED_MEMORIES = ("deleted_tenants", "_forgotten_ids")
"""Where deleted tenants' ids are kept on purpose, bounded: the scheduler's (refusing a late
request of one: ``MAX_DELETED_TENANTS``) and the gateway metrics' (exporting no series for one
again)."""

ABORTED_EARLY = ("node._aborted_early",)
"""The node's memory of aborts that found no request running (``ABORTED_EARLY_MAX`` ids, oldest
dropped first): the gateway's aborts of a deleted tenant's streams that the node had already
ended leave their ids there."""


class KvstrataServed(Served):
    SCHEDULING_POLICY = "kvstrata"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = KvstrataServed()
    yield s
    s.close()


@pytest.fixture(scope="module")
def admin(served: Served) -> str:
    """The admin key (the store gives its plaintext once, when it creates it)."""
    key = served.scheduler.store.ensure_admin_key()
    assert key is not None
    return key


def sizes(s: Served) -> dict[str, int]:
    """The length of each per-tenant structure of the node, the scheduler and the gateway."""
    engine = s.node.engine
    policy: Any = engine.scheduler.policy
    weights = engine.tiers.weights
    node = s.scheduler.nodes["n0"]
    return {
        "policy.tenants": len(policy.tenants), "vtc.counters": len(policy.vtc.counters),
        "rates._events": len(policy.rates._events), "rates._totals": len(policy.rates._totals),
        "interactive_seen": len(policy._interactive_seen), "floor_preempted": len(policy._floor_preempted_s),
        "scheduler.active_tenants": len(engine.scheduler.active_tenants),
        "grammar_active": len(engine._grammar_active),
        "weights._entries": len(weights._entries), "weights._holder_of": len(weights._holder_of),
        "weights._tenants": len(weights._tenants),
        "global.specs": len(s.scheduler.specs), "global.lost_sessions": len(s.scheduler.lost_sessions),
        "backlog.weights": len(node.backlog.weights), "backlog.by_tenant": len(node.backlog.by_tenant),
        "gateway.open_streams": len(s.servicer.open_streams),
    }


def serve_one(s: Served, key: str) -> None:
    request = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=PROMPT), session_id="g",
                                            sampling=inference_pb2.SamplingParams(max_tokens=2))
    events = list(s.stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),), timeout=60))
    assert events[-1].finished.completion_tokens == 2


def serve_http(s: Served, key: str) -> None:
    """A salted session turn with a routing key, and an ``n`` = 2 body, as ``key``'s tenant."""
    resident, s.key = s.key, key
    try:
        for body in ({"session_id": "h", "cache_salt": "u", "prompt_cache_key": "rk"}, {"n": 2}):
            status, got = s.post("/completions", {"prompt": PROMPT, "max_tokens": 2, **body})
            assert status == 200, got
    finally:
        s.key = resident


OWN_MODULES = ("services", "cache_node", "tenants")
"""The packages whose objects ``keyed_by`` walks into (not torch's, grpc's, asyncio's)."""


def keyed_by(tenant_ids: set[str], roots: dict[str, object]) -> list[str]:
    """The paths (``root.attribute.key...``) of every dict or set reachable from ``roots``
    through this project's objects (``OWN_MODULES``), dicts, sets, lists, tuples and deques
    whose key or member is, or holds (a tuple's item, a string's start), one of
    ``tenant_ids`` (ids or names). (A walk, not ``gc.get_objects``: CPython does not track a dict holding
    only strings and numbers, such as ``{tenant: count}``.)"""
    prefixes = tuple(tenant_ids)

    def holds(key: object) -> bool:
        if isinstance(key, str):
            return key.startswith(prefixes)
        return isinstance(key, tuple) and any(holds(k) for k in key)

    found, seen = [], set()
    stack: list[tuple[str, object]] = list(roots.items())
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        kind = type(obj)
        if issubclass(kind, dict):
            items = list(obj.items())  # type: ignore[attr-defined]
            if any(holds(k) for k, _ in items):
                found.append(path)
            stack += [(f"{path}.{str(k)[:24]}", v) for k, v in items]
        elif issubclass(kind, (set, frozenset)):
            if any(holds(k) for k in list(obj)):  # type: ignore[call-overload]
                found.append(path)
        elif issubclass(kind, (list, tuple, deque)):
            stack += [(f"{path}[]", v) for v in list(obj)]  # type: ignore[call-overload]
        elif kind.__module__.startswith(OWN_MODULES):
            fields = dict(getattr(obj, "__dict__", {}))
            fields |= {n: getattr(obj, n) for n in getattr(kind, "__slots__", ()) if hasattr(obj, n)}
            stack += [(f"{path}.{name}", value) for name, value in fields.items()]
    return found


def test_deleted_tenants_leave_no_per_tenant_state(served: Served, admin: str) -> None:
    s = served
    tenants = tenant_pb2_grpc.TenantServiceStub(s.channel)
    serve_one(s, s.key)  # the resident tenant's entries are part of the baseline
    before = sizes(s)
    assert before["vtc.counters"] == before["policy.tenants"] == 1, before  # (the structures are the ones fed)
    deleted = set()
    for i in range(CHURNED):
        spec = TenantSpec(name=f"churn-{i}", slo_class="interactive", min_tokens_per_s=5.0, weight=2.0)
        tenant, key = s.run(call(s.scheduler.register_tenant, spec))
        serve_one(s, key)
        serve_http(s, key)
        if i == 0:
            grown = sizes(s)
            assert grown["vtc.counters"] == grown["rates._events"] == grown["policy.tenants"] == 2, grown
        tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name=f"churn-{i}"),
                             metadata=(("authorization", f"Bearer {admin}"),), timeout=60)
        deleted |= {tenant.tenant_id, f"churn-{i}"}
    try:
        wait_for(lambda: sizes(s) == before, timeout_s=10.0)
    except AssertionError:
        assert sizes(s) == before  # (the structures that kept the deleted tenants)

    roots = {"node": s.node, "scheduler": s.scheduler, "gateway": s.servicer}
    resident = s.run(call(s.scheduler.get_tenant, "logprobs")).tenant_id
    reached = keyed_by({resident, "logprobs"}, roots)  # (the walk reaches the node's, scheduler's, gateway's)
    for where in ("node.engine.scheduler.policy.vtc.counters", "scheduler.specs", "auth._known_by_owner",
                  "gateway.metrics._series"):
        assert any(where in path for path in reached), (where, " ".join(sorted(reached)))

    def kept() -> list[str]:
        return [where for where in keyed_by(deleted, roots) if not where.endswith(DELETED_MEMORIES)]

    try:  # (a request's entries may still be on their way out)
        wait_for(lambda: not kept(), timeout_s=10.0)
    except AssertionError:
        assert kept() == [], "structures keep deleted tenants"


def test_a_tenant_deleted_mid_decode_leaves_no_state_and_the_node_serves_on(served: Served, admin: str) -> None:
    """A tenant deleted while four of its requests stream (decoding or waiting, each 400 tokens
    long): every stream ends ABORTED or UNAUTHENTICATED (none runs to its end), every
    per-tenant structure returns to its baseline with no entry keyed by the tenant's id or name,
    and the node keeps serving (no step fails on the dropped entries, e.g. a ``KeyError`` on
    its VTC counter or rate window). A guard, not a regression test (s37 review r3's probe):
    it passes on cd1a4a5 too; the purge runs only once none of the tenant's requests is left
    (``LLMEngine.forget_tenant``)."""
    s = served
    serve_one(s, s.key)
    before = sizes(s)
    spec = TenantSpec(name="inflight", slo_class="interactive", min_tokens_per_s=5.0, weight=2.0)
    tenant, key = s.run(call(s.scheduler.register_tenant, spec))
    ends: dict[int, tuple[str, int]] = {}
    decoding = threading.Event()

    def stream(i: int) -> None:
        request = inference_pb2.GenerateRequest(
            tokens=inference_pb2.TokenIds(ids=PROMPT), cache_salt=f"s{i}", session_id=f"g{i}",
            sampling=inference_pb2.SamplingParams(max_tokens=400, ignore_eos=True))
        n = 0
        try:
            for _ in s.stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),), timeout=120):
                n += 1
                if n == 2:  # past its first event: decoding
                    decoding.set()
            ends[i] = ("OK", n)
        except grpc.RpcError as e:
            ends[i] = (e.code().name, n)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    assert decoding.wait(60), "no stream of the tenant is decoding"
    tenant_pb2_grpc.TenantServiceStub(s.channel).DeleteTenant(
        tenant_pb2.DeleteTenantRequest(name="inflight"), metadata=(("authorization", f"Bearer {admin}"),), timeout=60)
    for thread in threads:
        thread.join(60)
    assert sorted(ends) == [0, 1, 2, 3], ends
    assert all(code in ("ABORTED", "UNAUTHENTICATED") and n < 400 for code, n in ends.values()), ends
    try:
        wait_for(lambda: sizes(s) == before, timeout_s=10.0)
    except AssertionError:
        assert sizes(s) == before  # (the structures that kept the deleted tenant)
    roots = {"node": s.node, "scheduler": s.scheduler, "gateway": s.servicer}

    def kept() -> list[str]:  # (``ABORTED_EARLY``: bounded, and no id of it is submitted again)
        return [where for where in keyed_by({tenant.tenant_id, "inflight"}, roots)
                if not where.endswith(DELETED_MEMORIES + ABORTED_EARLY)]

    try:  # (its requests' entries may still be on their way out)
        wait_for(lambda: not kept(), timeout_s=10.0)
    except AssertionError:
        assert kept() == [], "structures keep the deleted tenant"
    serve_one(s, s.key)  # the node still serves
