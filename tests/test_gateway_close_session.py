"""``CloseSession`` when the session's cache node fails, died or hangs (services/gateway.py,
``InferenceServicer._close_on_node``).

Regression (review 22d): a close that reached a node whose step loop had failed, before the
monitor marked it down, raised in the gateway: ``DELETE /v1/sessions/{id}`` answered HTTP 500
in plain text (gRPC UNKNOWN), and since the scheduler had dropped the route already, the
client's retry got NOT_FOUND. Now it answers as for a node known down: freed 0.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from services import gateway
from services.gateway import InferenceServicer
from services.tenant_call_slots import TenantCallSlots
from tests.gateway_harness import LocalActor


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: Any, details: str) -> None:
        raise Aborted(code, details)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:  # the key's id goes with the close
        return ()


class Scheduler:
    def close_session(self, session_id: str, tenant_id: str, key_id: str = "") -> tuple[str, list[str]]:
        return "n0", []


class Auth:
    async def tenant(self, context: Any) -> Any:
        return SimpleNamespace(tenant_id="t1")


class Node:
    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour

    async def close_session(self, session_id: str, tenant: str, turns: list[str]) -> int:
        if self.behaviour == "failed":
            raise RuntimeError("cache node n0: step loop failed: RuntimeError: injected step fault")
        if self.behaviour == "hangs":
            await asyncio.sleep(3600)
        return 42


def servicer(node: Node) -> InferenceServicer:
    s = InferenceServicer.__new__(InferenceServicer)  # only close_session's parts
    s.scheduler, s.auth, s.nodes = LocalActor(Scheduler()), Auth(), {"n0": LocalActor(node)}
    s.close_slots = TenantCallSlots()
    return s


@pytest.mark.parametrize(("behaviour", "freed"), [("answers", 42), ("failed", 0), ("hangs", 0)])
def test_a_close_is_answered_whatever_the_node_does(monkeypatch: pytest.MonkeyPatch, behaviour: str,
                                                    freed: int) -> None:
    monkeypatch.setattr(gateway, "NODE_CLOSE_TIMEOUT_S", 0.2)
    got = asyncio.run(servicer(Node(behaviour)).close_session(Context(), "s1"))
    assert got == freed
