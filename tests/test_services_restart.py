"""Restarting the services keeps tenants and API keys (SQLite state dir), and refuses the next
turn of a session whose history went with the restart."""

from __future__ import annotations

import grpc
import pytest

from kvstrata.v1 import inference_pb2, tenant_pb2
from tests.service_fixtures import chat, collect

pytestmark = pytest.mark.slow


def test_restart_keeps_tenants_and_keys(stack) -> None:
    key = stack.register("dora", slo_class=1)
    admin_key = stack.services.admin_key
    before = [t.spec.name for t in stack.tenants.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=stack.admin_md()).tenants]
    stack.restart()
    assert stack.services.admin_key == admin_key
    after = [t.spec.name for t in stack.tenants.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=stack.admin_md()).tenants]
    assert after == before and "dora" in after
    r = collect(stack.inference.Generate(chat("Hello!", 3), metadata=(("authorization", f"Bearer {key}"),)))
    assert r["finished"].completion_tokens > 0


def test_a_sessions_next_turn_after_a_restart_is_refused_not_run_without_its_history(stack) -> None:
    """Regression (review 26b F2): after ``kvstrata down``/``up`` (here ``stop_services`` and
    ``start_services`` on the same state dir) a session's next turn was admitted as its first:
    its prompt was the new message alone (12 tokens) and the client got OK, never learning
    that the history was gone. Now it is refused ABORTED ("history was lost"), as the turn of
    a session whose node restarted is; once the client closes it, it starts anew. A session
    closed before the restart starts anew at once."""
    key = stack.register("rita")
    md = (("authorization", f"Bearer {key}"),)
    first = collect(stack.inference.Generate(chat("Remember the number 41, please.", 4, session_id="s1"),
                                             metadata=md, timeout=120))
    assert first["finished"].completion_tokens == 4
    collect(stack.inference.Generate(chat("Hello there.", 2, session_id="done"), metadata=md, timeout=120))
    stack.inference.CloseSession(inference_pb2.CloseSessionRequest(session_id="done"), metadata=md, timeout=30)

    stack.restart()
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
