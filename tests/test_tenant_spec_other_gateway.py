"""A tenant spec changed through one gateway is used by every gateway from the tenant's next
request (review s35 C, C2).

The fault: each gateway's ``Authenticator`` caches a key that passed for ``_CACHE_TTL_S``
(10 s) with its ``Tenant``, spec included, and only the gateway that made an ``UpdateTenant``
forgets it. So at a second gateway, for up to 10 s, a tenant moved out of a shared cache
namespace still had its prompts hashed into that namespace (reading and writing its prefix KV),
and the old ``allowed_policies``, ``max_context_tokens`` and SLO values still applied.

Now each admission carries the digest of the spec the gateway prepared the request with
(``tenants.model.spec_digest``); the scheduler, which holds every tenant's current spec, refuses
a stale one (UNAVAILABLE ``tenant_changed``), and the gateway forgets the tenant's cached keys,
authenticates the call's key again and prepares the request anew, once, unseen by its client.

Real ``GlobalSchedulerService`` (tenant store on disk), real gateway (gRPC server, data plane);
the cache node's command inbox records each request handed on to it and answers it (``started``,
``finished``) on the gateway's event inbox, as a node would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from services import data_plane
from services.global_scheduler_admission import GlobalSchedulerService, _admission_request
from tenants.model import TenantSpec, spec_digest
from tests.gateway_harness import LocalActor


class _Scheduler(LocalActor):
    """The scheduler as the gateway calls it; ``release`` (which the gateway sends without
    waiting, as Ray's fire-and-forget) runs at once."""

    def __getattr__(self, name: str) -> Any:
        if name == "release":
            return _Now(self.obj.release)
        return super().__getattr__(name)


class _Now:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> None:
        self.fn(*args, **kwargs)


class _AnsweringNode:
    """A cache node's command inbox as the scheduler sends to it: records each submitted
    request and answers it at once (``started`` then ``finished``, no tokens) on the data plane,
    to the gateway's event inbox it names."""

    def __init__(self) -> None:
        self.submitted: list[dict[str, Any]] = []
        self.pusher = data_plane.PushSockets()

    def send(self, address: str, message: dict[str, Any]) -> bool:
        if message.get("op") == "submit":
            req = message["req"]
            self.submitted.append(req)
            n = len(req.get("token_ids") or ()) or 4
            rid = req["request_id"]
            self.pusher.send_events(message["sub"], [
                [rid, {"type": "started", "request_id": rid, "node_id": "n0", "prompt_tokens": n}],
                [rid, {"type": "finished", "finish_reason": "length", "prompt_tokens": n, "completion_tokens": 0}],
            ])
        return True

    def forget(self, address: str) -> None:
        pass

    def close(self) -> None:
        self.pusher.close()


def test_a_spec_changed_through_another_gateway_is_used_at_once(tmp_path: Path) -> None:
    """eve shares the cache namespace "team"; her key is cached at this gateway. The admin
    moves her to her own namespace and allows only "full" through another gateway (the
    scheduler's ``update_tenant``). Old code: her next request here was hashed into "team"
    (and a "snapkv" request admitted). Now it runs in her own namespace, with no error to the
    client (its first admission was refused ``tenant_changed`` and never reached the node), a
    "snapkv" request is PERMISSION_DENIED, and the following call, with the fresh spec cached,
    is admitted at its first try."""
    from kvstrata.v1 import inference_pb2_grpc
    from services import gateway_server
    from tests.service_fixtures import chat
    from tests.test_metrics_forget_tenant import FakeNode, tiny_checkpoint

    async def generate(channel: grpc.aio.Channel, key: str, **kw: Any) -> tuple[grpc.StatusCode, str]:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            chat("hello", max_tokens=2, **kw), metadata=(("authorization", f"Bearer {key}"),), timeout=10)
        try:
            events = [event async for event in call]
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
        assert events[-1].WhichOneof("event") == "finished"
        return grpc.StatusCode.OK, ""

    async def go() -> None:
        sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        node = _AnsweringNode()
        sched.attach_nodes({"n0": "tcp://127.0.0.1:9"}, sender=node)
        gw = gateway_server.Gateway(_Scheduler(sched), {"n0": LocalActor(FakeNode())}, str(tiny_checkpoint()))
        port = await gw.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                eve, key = await sched.register_tenant(TenantSpec(name="eve", cache_namespace="team"))
                assert await generate(channel, key) == (grpc.StatusCode.OK, "")  # her key is cached here now
                assert [r["cache_namespace"] for r in node.submitted] == ["team"]
                await sched.update_tenant("eve", TenantSpec(name="eve", allowed_policies=["full"]))  # another gateway
                rejected_before = sched_rejections(gw, "tenant_changed")
                assert await generate(channel, key) == (grpc.StatusCode.OK, "")
                assert [r["cache_namespace"] for r in node.submitted] == ["team", f"tenant:{eve.tenant_id}"]
                assert sched_rejections(gw, "tenant_changed") == rejected_before + 1  # refused once, retried
                code, details = await generate(channel, key, policy="snapkv-0.5")
                assert code == grpc.StatusCode.PERMISSION_DENIED and "not allowed" in details, (code, details)
                assert await generate(channel, key) == (grpc.StatusCode.OK, "")  # the fresh spec is cached
                assert sched_rejections(gw, "tenant_changed") == rejected_before + 1
                assert [r["cache_namespace"] for r in node.submitted][2:] == [f"tenant:{eve.tenant_id}"]
                assert not sched.requests  # each admitted attempt released, the refused one never held
        finally:
            await gw.stop(0)
            sched.close_data_plane()
            sched.store.close()

    asyncio.run(asyncio.wait_for(go(), 120))


def sched_rejections(gw: Any, reason: str) -> float:
    """The gateway's ``kvstrata:admission_rejections`` count of ``reason``, all tenants."""
    total = 0.0
    for metric in gw.metrics.rejections.collect():
        for sample in metric.samples:
            if sample.labels.get("reason") == reason and sample.name.endswith("_total"):
                total += sample.value
    return total


def test_the_scheduler_refuses_a_stale_spec_digest(tmp_path: Path) -> None:
    """``admit``: the digest of the tenant's current spec (or none) is admitted; another one is
    UNAVAILABLE ``tenant_changed`` with a retry hint, and so is the old spec's after an update."""
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    try:
        ann, _ = sched.store.register(TenantSpec("ann", cache_namespace="team"))
        sched.specs[ann.tenant_id] = ann.spec
        old = spec_digest(ann.spec)
        assert sched.admit(ann.tenant_id, "ann/r1", prompt_tokens=8, spec=old).code == "OK"
        asyncio.run(sched.update_tenant("ann", TenantSpec("ann")))
        adm = sched.admit(ann.tenant_id, "ann/r2", prompt_tokens=8, spec=old)
        assert (adm.code, adm.reason) == ("UNAVAILABLE", "tenant_changed") and adm.retry_after_s > 0
        assert "ann/r2" not in sched.requests
        assert sched.admit(ann.tenant_id, "ann/r3", prompt_tokens=8, spec=spec_digest(TenantSpec("ann"))).code == "OK"
        assert sched.admit(ann.tenant_id, "ann/r4", prompt_tokens=8).code == "OK"  # not said: not checked
    finally:
        sched.store.close()


@pytest.mark.parametrize("bad", [1, b"0" * 16, "0" * 15, "0" * 17, "G" * 16, "A" * 16, ["0" * 16]])
def test_an_admissions_spec_digest_is_checked_as_untrusted(bad: Any) -> None:
    """The data plane's admission message: ``spec`` is "" (absent) or 16 lowercase hex
    characters; anything else is a malformed admission (ValueError)."""
    from cache_node.sampling_params import SamplingParams
    from services.node_request import NodeRequest

    req = data_plane.request_to_wire(NodeRequest(request_id="t/r", tenant="t", cache_namespace="",
                                                 sampling=SamplingParams(), token_ids=(1, 2)))
    msg = {"id": 1, "req": req, "sub": "tcp://127.0.0.1:1", "hashes": []}
    assert _admission_request(msg)[4] == ""
    assert _admission_request({**msg, "spec": "0123456789abcdef"})[4] == "0123456789abcdef"
    with pytest.raises(ValueError, match="spec"):
        _admission_request({**msg, "spec": bad})
