"""Restarting the services keeps tenants and API keys (SQLite state dir), and refuses the next
turn of a session whose history went with the restart."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvstrata.v1 import inference_pb2, tenant_pb2
from tests.service_fixtures import chat, collect

pytestmark = pytest.mark.slow


def _tenant_names(stack) -> list[str]:
    return [t.spec.name for t in stack.tenants.ListTenants(tenant_pb2.ListTenantsRequest(),
                                                          metadata=stack.admin_md()).tenants]


@pytest.fixture(scope="module")
def restarted(stack) -> dict[str, Any]:
    """Both tests' state before the restart (tenants "dora" and "rita"; rita's session "s1"
    after one turn, her session "done" closed after one), then ONE restart of the services
    (``stack.restart``: ``stop_services`` and ``start_services`` on the same state dir)."""
    before: dict[str, Any] = {"dora": stack.register("dora", slo_class=1), "rita": stack.register("rita"),
                              "admin_key": stack.services.admin_key}
    md = (("authorization", f"Bearer {before['rita']}"),)
    before["first"] = collect(stack.inference.Generate(chat("Remember the number 41, please.", 4, session_id="s1"),
                                                       metadata=md, timeout=120))
    collect(stack.inference.Generate(chat("Hello there.", 2, session_id="done"), metadata=md, timeout=120))
    stack.inference.CloseSession(inference_pb2.CloseSessionRequest(session_id="done"), metadata=md, timeout=30)
    before["tenants"] = _tenant_names(stack)
    stack.restart()
    return before


def test_restart_keeps_tenants_and_keys(stack, restarted: dict[str, Any]) -> None:
    assert stack.services.admin_key == restarted["admin_key"]
    after = _tenant_names(stack)
    assert after == restarted["tenants"] and "dora" in after
    r = collect(stack.inference.Generate(chat("Hello!", 3), metadata=(("authorization", f"Bearer {restarted['dora']}"),)))
    assert r["finished"].completion_tokens > 0


def test_a_sessions_next_turn_after_a_restart_is_refused_not_run_without_its_history(
        stack, restarted: dict[str, Any]) -> None:
    """Regression (review 26b F2): after ``kvstrata down``/``up`` (here ``stop_services`` and
    ``start_services`` on the same state dir) a session's next turn was admitted as its first:
    its prompt was the new message alone (12 tokens) and the client got OK, never learning
    that the history was gone. Now it is refused ABORTED ("history was lost"), as the turn of
    a session whose node restarted is; once the client closes it, it starts anew. A session
    closed before the restart starts anew at once."""
    md = (("authorization", f"Bearer {restarted['rita']}"),)
    assert restarted["first"]["finished"].completion_tokens == 4

    nxt = chat("Which number was it?", 4, session_id="s1")
    with pytest.raises(grpc.RpcError) as lost:
        collect(stack.inference.Generate(nxt, metadata=md, timeout=120))
    assert lost.value.code() == grpc.StatusCode.ABORTED, lost.value.details()  # before: OK, 12 prompt tokens
    assert "history was lost" in lost.value.details() and "CloseSession" in lost.value.details()
    reopened = collect(stack.inference.Generate(chat("Hello there.", 2, session_id="done"), metadata=md, timeout=120))
    assert reopened["finished"].completion_tokens == 2

    stack.inference.CloseSession(inference_pb2.CloseSessionRequest(session_id="s1"), metadata=md, timeout=30)
    anew = collect(stack.inference.Generate(nxt, metadata=md, timeout=120))
    alone = collect(stack.inference.Generate(chat("Which number was it?", 4), metadata=md, timeout=120))
    assert anew["finished"].prompt_tokens == alone["finished"].prompt_tokens  # a first turn, as the client chose
