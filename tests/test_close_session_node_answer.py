"""CloseSession takes its node's answer as untrusted: tokens freed an int in [-1,
``MAX_FREED_TOKENS``] (-1: none by that id), anything else freed 0, as a node whose call failed.

Regression (s38): the answer was ``int()``-ed: 2**32 tokens failed the gRPC call UNKNOWN
(``CloseSessionResponse.freed_tokens`` is a uint32) after the scheduler had dropped the session,
so the client's retry got NOT_FOUND; -7 answered NOT_FOUND for a session just closed; ``"5"``
and ``5.9`` counted as 5.

A real ``GlobalSchedulerService`` (the session routed by a real admission) and
``Authenticator``, the gateway's ``InferenceServicer.CloseSession``; the node is a stand-in,
since what is tested is answers no real node sends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvstrata.v1 import inference_pb2
from services.auth import Authenticator
from services.gateway import InferenceServicer
from services.gateway_inputs import session_scope
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO, LocalActor
from tests.grpc_context import GrpcContext

ANSWERS = (1 << 32, -7, "5", 5.9, None, [3])


class _Node:
    """A cache node's handle whose ``close_session`` answers ``answer``."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.close_session = LocalActor(self).answer_close

    def answer_close(self, session_id: str, tenant: str, turns: list[str] = ()) -> Any:  # the node's signature
        return self.answer


def test_a_malformed_close_answer_is_freed_zero(tmp_path: Path) -> None:
    async def run() -> list[int]:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 4})
        try:
            tenant, key = await scheduler.register_tenant(TenantSpec("ann"))
            handle = LocalActor(scheduler)
            freed = []
            for i, answer in enumerate((*ANSWERS, 12)):
                session = session_scope(tenant.tenant_id, "", f"s{i}")
                assert scheduler.admit(tenant.tenant_id, f"{tenant.tenant_id}/r{i}", session_id=session).code == "OK"
                servicer = InferenceServicer(handle, Authenticator(handle), {"n0": _Node(answer)}, {"n0": NODE_INFO},
                                             None, "tcp://127.0.0.1:9")
                resp = await servicer.CloseSession(inference_pb2.CloseSessionRequest(session_id=f"s{i}"),
                                                   GrpcContext(key))
                freed.append(resp.freed_tokens)
            return freed
        finally:
            scheduler.store.close()

    assert asyncio.run(run()) == [0] * len(ANSWERS) + [12]
