"""Admin Flush and Drain with a node that does not answer (review 29a F7).

Before: both answered OK with the other nodes' counts (zeros with one node), so an operator
purging KV was told it was gone while the silent node (and the spill tier it flushes) still held
it. Now the call ends UNAVAILABLE naming the node and what the others did, on one line (the
CLI prints the first line of a failed call's details).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvstrata.v1 import admin_pb2
from services.gateway_admin import AdminServicer

_FREED = {"device": 5, "prefixes": 2, "host": 7, "spill": 6}


class _Method:
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    async def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self.answer is None:  # stopped, or its step loop stuck: never answers
            await asyncio.Event().wait()
        if isinstance(self.answer, BaseException):  # the call failed (the node died, its loop failed)
            raise self.answer
        return self.answer


class _Node:
    def __init__(self, freed: dict[str, int] | None, aborted: int | None) -> None:
        self.flush_by_tier, self.drain = _Method(freed), _Method(aborted)


class _Scheduler:
    def __init__(self) -> None:
        self.flushed = 0
        self.flush_index = self

    async def remote(self) -> None:
        self.flushed += 1


class _Auth:
    async def admin(self, context: Any) -> None:
        return None

    async def recheck(self, context: Any, caller: Any) -> Any:  # the admin key, still valid
        return caller


class _Aborted(Exception):
    pass


class _Context:
    """``ServicerContext.abort``: records the status and raises, as grpc.aio's does."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:  # the Drain reads its admin key's id
        return ()


def _servicer(*nodes: _Node) -> tuple[AdminServicer, _Scheduler]:
    scheduler = _Scheduler()
    servicer = AdminServicer(scheduler, _Auth(), {f"n{i}": n for i, n in enumerate(nodes)},  # type: ignore[arg-type]
                             node_timeout_s=0.3)
    return servicer, scheduler


def test_a_flush_a_node_did_not_answer_is_unavailable_naming_it() -> None:
    servicer, scheduler = _servicer(_Node(_FREED, 0), _Node(None, None))
    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(servicer.Flush(admin_pb2.FlushRequest(), context))
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert context.details.startswith("flush incomplete: cache node n1 (did not answer within 0.3 s) did not flush")
    assert "n0" not in context.details and "freed 20 KV blocks (device 5, compressed prefixes 2, host 7, spill 6)" \
        in context.details
    assert "\n" not in context.details  # `kvstrata admin flush` prints the first line alone
    assert scheduler.flushed == 1  # the index forgets what the nodes that answered dropped


def test_a_drain_a_node_did_not_answer_is_unavailable_naming_it() -> None:
    servicer, _ = _servicer(_Node(_FREED, 3), _Node(None, None), _Node(None, None))
    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(servicer.Drain(admin_pb2.DrainRequest(timeout_s=0.2), context))
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert context.details.startswith(
        "drain incomplete: cache nodes n1 (did not answer within 0.5 s), n2 (did not answer within 0.5 s) did not drain")
    assert "aborted 3 requests" in context.details and "\n" not in context.details


def test_a_node_whose_call_failed_or_answered_malformed_is_named() -> None:
    """Session 30: a node whose Flush or Drain call failed with an error rather than a timeout
    (it died between the monitor's check and the call, its step loop failed) or answered
    something that is not counts was counted as 0 and not named, and the call answered OK
    while that node's KV (and the spill tier it flushes) or requests could still be there."""
    import ray.exceptions

    died = ray.exceptions.RayActorError()
    servicer, scheduler = _servicer(_Node(_FREED, 3), _Node(died, died), _Node({"device": "9", "host": -1}, -2),
                                    _Node(RuntimeError("step loop failed: CUDA error"), True))
    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(servicer.Flush(admin_pb2.FlushRequest(), context))
    assert context.code == grpc.StatusCode.UNAVAILABLE and "\n" not in context.details
    assert context.details.startswith("flush incomplete: cache nodes n1 (failed: ") and "n0" not in context.details
    assert "n2 (sent a malformed answer), n3 (failed: step loop failed: CUDA error) did not flush" in context.details
    assert "freed 20 KV blocks" in context.details and scheduler.flushed == 1
    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(servicer.Drain(admin_pb2.DrainRequest(timeout_s=0), context))
    assert context.details.startswith("drain incomplete: cache nodes n1 (failed: ")
    assert "n2 (sent a malformed answer), n3 (sent a malformed answer) did not drain" in context.details
    assert "aborted 3 requests" in context.details


def test_every_node_answering_is_ok() -> None:
    servicer, scheduler = _servicer(_Node(_FREED, 2), _Node({"device": 1, "prefixes": 0, "host": 0, "spill": 0}, 1))
    context = _Context()
    flushed = asyncio.run(servicer.Flush(admin_pb2.FlushRequest(), context))
    drained = asyncio.run(servicer.Drain(admin_pb2.DrainRequest(timeout_s=0.0), context))
    assert (flushed.freed_blocks, flushed.device_blocks, drained.aborted) == (21, 6, 3)
    assert context.code is None and scheduler.flushed == 1


def test_a_node_held_down_is_named_as_skipped_by_flush_and_drain() -> None:
    """Trial 29k P1: with its only node held down by the monitor, ``kvstrata admin flush``
    printed "0 KV blocks freed" and exited 0; the node, a stalled step loop, still held its
    cache when it came back. The responses now name each node skipped and why, and the CLI
    says what that leaves."""
    import types

    from cli.admin import flush_summary, skipped_note
    from services.node_monitor import NodeHealth

    servicer, _ = _servicer(_Node(_FREED, 2), _Node(None, None))
    servicer.monitor = types.SimpleNamespace(state={"n0": NodeHealth(), "n1": NodeHealth(
        healthy=False, failure="its step loop made no progress for 61 s")})
    flushed = asyncio.run(servicer.Flush(admin_pb2.FlushRequest(), _Context()))
    assert flushed.freed_blocks == sum(_FREED.values())
    assert list(flushed.skipped_nodes) == ["n1: its step loop made no progress for 61 s"]
    assert "skipped 1 cache node the gateway holds down (n1: its step loop" in flush_summary(flushed)
    drained = asyncio.run(servicer.Drain(admin_pb2.DrainRequest(timeout_s=0), _Context()))
    assert (drained.aborted, list(drained.skipped_nodes)) == (2, list(flushed.skipped_nodes))
    assert skipped_note([], "x") == ""


def test_the_cli_exits_1_naming_skipped_nodes_whatever_their_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 29o F3/F4: ``kvstrata admin flush`` / ``drain`` with nodes skipped exited 0, and a
    node's reason holding rich markup (``[/x]``, partly the node's own text) crashed the print.
    Now the line is printed as it is and the command exits 1."""
    import contextlib
    import types

    from typer.testing import CliRunner

    import cli.admin as cli_admin

    reason = "n1: step loop stalled [/x] [bold]"
    stub = types.SimpleNamespace(
        Flush=lambda *a, **k: admin_pb2.FlushResponse(freed_blocks=3, device_blocks=3, skipped_nodes=[reason]),
        Drain=lambda *a, **k: admin_pb2.DrainResponse(aborted=1, skipped_nodes=[reason]))
    monkeypatch.setattr(cli_admin.admin_pb2_grpc, "AdminServiceStub", lambda channel: stub)
    monkeypatch.setattr(cli_admin, "gateway_channel", lambda gateway: contextlib.nullcontext(None))
    monkeypatch.setattr(cli_admin, "admin_metadata", lambda gateway: ())
    for command, words in ((["flush"], "flushed: 3 KV blocks freed"), (["drain"], "drained: 1 request aborted")):
        result = CliRunner().invoke(cli_admin.admin_app, command)
        assert result.exit_code == 1, (command, result.output, result.exception)
        text = " ".join(result.output.split())
        assert words in text and "skipped 1 cache node" in text and "[/x] [bold]" in text, text
