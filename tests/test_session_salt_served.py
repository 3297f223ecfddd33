"""A session belongs to the ``cache_salt`` its turns were sent under, end to end (review s36 E1;
the fault and the fix: tests/test_session_salt.py).

On the real stack of ``test_logprobs_served`` (a real CacheNode with a tiny random Llama, the
scheduler's admission server, the gateway's gRPC server and its OpenAI app, the real data
plane; no Ray): a session opened with ``POST /v1/completions`` under salt "u1" is neither
continued nor closed by a turn or a close under salt "u2" or under no salt naming the same
``session_id``; those open, and close, sessions of their own; the u1 session's own next turn
continues from its whole history, and its close (``DELETE /v1/sessions/{id}?cache_salt=u1``, or
gRPC ``CloseSession`` with ``cache_salt``) frees it.

On fa49863 the u2 turn's prompt was u1's history with its own 3 tokens after it (the node puts
the history in front of a token-id turn), and a close under any salt closed u1's session.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvstrata.v1 import inference_pb2
from tenants.model import TenantSpec
from tests.loop_plane import call, wait_for
from tests.test_logprobs_served import Served

FIRST = [504, 3451, 314, 260, 2644, 282, 4649, 47, 1000, 2035, 30]  # u1's private first turn
PROBE = [7, 8, 9]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def turn(s: Served, session: str, prompt: list[int], salt: str | None) -> dict[str, Any]:
    """One session turn (greedy, ``MAX_TOKENS``); its usage."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                            "session_id": session}
    if salt is not None:
        body["cache_salt"] = salt
    status, got = s.post("/completions", body)
    assert status == 200, got
    return got["usage"]


def delete(s: Served, session: str, query: str = "") -> tuple[int, Any]:
    """``DELETE /v1/sessions/{session}`` (the id URL-encoded) with ``query``: status, JSON body."""
    url = f"{s.base}/sessions/{urllib.parse.quote(session, safe='')}{query}"
    req = urllib.request.Request(url, method="DELETE", headers={"Authorization": f"Bearer {s.key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def grpc_close(s: Served, session: str, salt: str) -> int:
    resp = s.stub.CloseSession(inference_pb2.CloseSessionRequest(session_id=session, cache_salt=salt),
                               metadata=(("authorization", f"Bearer {s.key}"),), timeout=60)
    return resp.freed_tokens


def test_a_turn_under_another_salt_or_none_never_reaches_the_session(served: Served) -> None:
    """u1 opens "chat-1"; a u2 turn and an unsalted turn naming "chat-1" are each a first turn
    of a session of their own (their prompt their own 3 tokens, nothing cached), and u1's next
    turn still continues from its whole history (its 11 + 4 tokens, all but the last cached).
    Each of the three sessions closes under its own salt, freeing its own history."""
    s = served
    u1 = turn(s, "chat-1", FIRST, "u1")
    assert u1["prompt_tokens"] == len(FIRST)
    for salt in ("u2", None):
        other = turn(s, "chat-1", PROBE, salt)
        assert other["prompt_tokens"] == len(PROBE), f"salt {salt}: its turn was put after u1's history"
        assert other["prompt_tokens_details"]["cached_tokens"] == 0
    again = turn(s, "chat-1", PROBE, "u1")
    history = len(FIRST) + MAX_TOKENS
    assert again["prompt_tokens"] == history + len(PROBE)
    assert again["prompt_tokens_details"]["cached_tokens"] == history - 1
    assert delete(s, "chat-1", "?cache_salt=u2") == (200, {"id": "chat-1", "object": "session.deleted",
                                                           "deleted": True, "freed_tokens": len(PROBE) + MAX_TOKENS})
    assert delete(s, "chat-1")[1]["freed_tokens"] == len(PROBE) + MAX_TOKENS
    assert delete(s, "chat-1", "?cache_salt=u1")[1]["freed_tokens"] == history + len(PROBE) + MAX_TOKENS
    assert delete(s, "chat-1", "?cache_salt=u1")[0] == 404


def test_a_close_under_another_salt_or_none_leaves_the_session(served: Served) -> None:
    """u1 opens "chat-2" (its id holding a "/"); a close naming it under u2, under no salt, or
    under a salt whose bytes merely look alike, by HTTP or gRPC, is NOT_FOUND and frees nothing:
    u1's next turn continues from its whole history. gRPC ``CloseSession`` with u1's salt
    closes it (a session is the tenant's, whichever API opened it)."""
    s = served
    sid = "chat/2"
    turn(s, sid, FIRST, "u1")
    for query in ("?cache_salt=u2", "", "?cache_salt=", "?cache_salt=U1"):  # (u1%00: 400, test_client_ids)
        status, body = delete(s, sid, query)
        assert status == 404, (query, body)
        assert body["error"]["code"] == "not_found"
    for salt in ("u2", ""):
        with pytest.raises(grpc.RpcError) as refused:
            grpc_close(s, sid, salt)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    again = turn(s, sid, PROBE, "u1")
    history = len(FIRST) + MAX_TOKENS
    assert again["prompt_tokens_details"]["cached_tokens"] == history - 1
    assert grpc_close(s, sid, "u1") == history + len(PROBE) + MAX_TOKENS


def test_a_close_names_only_cache_salt_in_its_query(served: Served) -> None:
    """A query parameter other than ``cache_salt`` (a misspelt salt would close the unsalted
    session), a repeated one or an over-long salt is a 400 naming it, and closes nothing; a bad
    key is a 401 first."""
    s = served
    turn(s, "chat-3", FIRST, None)
    for query, param in [("?salt=u1", "salt"), ("?cache_salt=a&cache_salt=b", "cache_salt"),
                         (f"?cache_salt={'x' * 257}", "cache_salt"), ("?cache%20salt=u1", None)]:
        status, body = delete(s, "chat-3", query)
        assert (status, body["error"]["code"], body["error"]["param"]) == (400, "invalid_argument", param), query
    key, s.key = s.key, "sk-nonsense"
    try:
        assert delete(s, "chat-3", "?salt=u1")[0] == 401
    finally:
        s.key = key
    assert delete(s, "chat-3")[1]["freed_tokens"] == len(FIRST) + MAX_TOKENS


def test_a_tenant_moved_to_another_namespace_has_its_open_sessions_refused(served: Served) -> None:
    """The node's own guard (``cache_node.sessions.check_turn``), end to end: a tenant sharing
    the namespace "team" opens a session; the admin moves it to its own namespace. The session's
    next turn would run in the namespace the tenant left (its history's KV is "team"'s): it is
    refused FAILED_PRECONDITION (400 ``failed_precondition``: the client's own session, which it
    must close and open anew; cfcfb59 answered PERMISSION_DENIED, 403) for that request alone,
    its history kept, and the close frees it; the same id then opens a new session in the
    tenant's own namespace. On fa49863 the turn ran on, continuing the history computed in
    "team"."""
    s = served
    key = s.key
    _, s.key = s.run(call(s.scheduler.register_tenant, TenantSpec(name="mover", cache_namespace="team")))
    try:
        turn(s, "chat-4", FIRST, None)
        s.run(call(s.scheduler.update_tenant, "mover", TenantSpec(name="mover")))
        status, body = s.post("/completions", {"prompt": PROBE, "max_tokens": MAX_TOKENS, "session_id": "chat-4"})
        assert (status, body["error"]["code"]) == (400, "failed_precondition"), body
        assert "team" not in body["error"]["message"] and "close it" in body["error"]["message"]
        assert "DELETE /v1/sessions/" in body["error"]["message"]
        request = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=PROBE), session_id="chat-4",
                                                sampling=inference_pb2.SamplingParams(max_tokens=MAX_TOKENS))
        with pytest.raises(grpc.RpcError) as refused:
            list(s.stub.Generate(request, metadata=(("authorization", f"Bearer {s.key}"),), timeout=60))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "CloseSession" in (refused.value.details() or "")
        assert delete(s, "chat-4")[1]["freed_tokens"] == len(FIRST) + MAX_TOKENS
        fresh = turn(s, "chat-4", PROBE, None)
        assert fresh["prompt_tokens"] == len(PROBE)
        assert delete(s, "chat-4")[1]["freed_tokens"] == len(PROBE) + MAX_TOKENS
    finally:
        s.key = key


def cli_close(s: Served, session: str, *options: str) -> Any:
    """``kvstrata close-session`` (the real CLI app, in process) at the gateway's gRPC address."""
    from typer.testing import CliRunner

    from cli import main as cli
    return CliRunner().invoke(cli.app, ["close-session", "--gateway", s.address, *options, session],
                              env={"KVSTRATA_API_KEY": s.key, "COLUMNS": "200"})


def test_the_cli_closes_a_session_under_its_cache_salt(served: Served) -> None:
    """A session opened through the HTTP API with a cache_salt is closed by ``kvstrata
    close-session --cache-salt`` naming that salt, and by no other salt nor none (NOT_FOUND,
    exit 1, its history kept). Before s37 the CLI sent no salt (no such option, exit 2): a user
    could close only unsalted sessions from it."""
    s = served
    turn(s, "chat-5", FIRST, "u1")
    for options in ((), ("--cache-salt", "u2")):
        missing = cli_close(s, "chat-5", *options)
        assert missing.exit_code == 1 and "NOT_FOUND" in missing.output, (options, missing.output)
    too_long = cli_close(s, "chat-5", "--cache-salt", "x" * 257)
    assert too_long.exit_code == 2 and "at most 256" in too_long.output, too_long.output
    closed = cli_close(s, "chat-5", "--cache-salt", "u1")
    assert closed.exit_code == 0, closed.output
    freed = len(FIRST) + MAX_TOKENS
    assert f"closed session chat-5 (cache_salt 'u1'): {freed} tokens of history freed" in closed.output
    assert delete(s, "chat-5", "?cache_salt=u1")[0] == 404


def completion(s: Served, request_id: str, salt: str | None, max_tokens: int = 2, stream: bool = False) -> Any:
    """``POST /v1/completions`` of ``PROBE`` with ``X-Request-Id: request_id`` under ``salt``:
    the open response (a stream: read it, or close it to cancel), or the ``HTTPError``."""
    body: dict[str, Any] = {"model": s.model, "prompt": PROBE, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(f"{s.base}/completions", json.dumps(body).encode(),
                                 {"Authorization": f"Bearer {s.key}", "Content-Type": "application/json",
                                  "X-Request-Id": request_id})
    try:
        return urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as err:
        return err


def test_a_request_id_in_flight_under_one_salt_is_free_under_another(served: Served) -> None:
    """A request id is one (tenant, cache_salt, id), as a session id is: while "rid-1" streams
    under salt u1, the same id under u2, under no salt (HTTP, and gRPC, which sends none) runs,
    and only a reuse under u1 is 409 ALREADY_EXISTS. Before s37 every reuse was refused: a
    caller under u2 learnt which ids u1's callers had in flight (ALREADY_EXISTS as an oracle)
    and could keep them from an id by holding it first."""
    s = served
    held = completion(s, "rid-1", "u1", max_tokens=1400, stream=True)
    try:
        assert held.status == 200 and held.readline().startswith(b"data: ")  # in flight: it streams

        def refused_under_u1() -> None:
            again = completion(s, "rid-1", "u1")
            assert again.code == 409, again.read()
            assert json.loads(again.read())["error"]["message"] == "request 'rid-1' is in flight already"

        refused_under_u1()
        for salt in ("u2", None):
            other = completion(s, "rid-1", salt)
            assert other.status == 200, (salt, other.read())
            assert json.loads(other.read())["usage"]["completion_tokens"] == 2
        request = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=PROBE), request_id="rid-1",
                                                sampling=inference_pb2.SamplingParams(max_tokens=2))
        events = list(s.stub.Generate(request, metadata=(("authorization", f"Bearer {s.key}"),), timeout=60))
        assert events[-1].finished.completion_tokens == 2
        refused_under_u1()  # (the held request was in flight all along)
    finally:
        held.close()  # the client hangs up: the gateway aborts it
    wait_for(lambda: not s.servicer._in_flight)


def cli_generate(s: Served, prompt: str, *options: str) -> Any:
    """``kvstrata generate`` (the real CLI app, in process; greedy, 4 tokens) at the gateway."""
    from typer.testing import CliRunner

    from cli import main as cli
    return CliRunner().invoke(cli.app, ["generate", "--gateway", s.address, "--max-tokens", str(MAX_TOKENS),
                                        *options, prompt], env={"KVSTRATA_API_KEY": s.key, "COLUMNS": "300"})


def test_the_cli_opens_and_continues_a_session_under_its_cache_salt(served: Served) -> None:
    """``kvstrata generate --session S --cache-salt u1`` (gRPC ``GenerateRequest.cache_salt``)
    opens u1's session S: no unsalted close finds it, the next u1 turn continues its history
    (cached on the device), and the HTTP API's close under u1 frees it. Before s37 gRPC had no
    salt and the CLI no option (exit 2): a salted session could not be opened or continued."""
    s = served
    first = cli_generate(s, "Name a colour.", "--session", "chat-6", "--cache-salt", "u1")
    assert first.exit_code == 0, first.output
    assert delete(s, "chat-6")[0] == 404  # (not the unsalted session of that id)
    again = cli_generate(s, "Another one.", "--session", "chat-6", "--cache-salt", "u1")
    assert again.exit_code == 0, again.output
    line = re.search(r"(\d+) prompt tokens \((\d+) cached on the device\), (\d+) generated", again.output)
    assert line is not None, again.output
    prompt, cached, generated = map(int, line.groups())
    assert 0 < cached < prompt, again.output
    status, body = delete(s, "chat-6", "?cache_salt=u1")
    assert status == 200 and body["freed_tokens"] == prompt + generated, body


def test_a_routing_key_is_one_salts_alone(served: Served) -> None:
    """``prompt_cache_key`` "rk" under salts u1 and u2 and under none is three routing keys at
    the scheduler (each remembers its own node), as request and session ids are one salt's:
    before s37 the three were one key, so a caller under u2 was sent to the node u1's "rk" last
    went to (its started event names it), though no cached block is shared across salts."""
    s = served
    tenant_id = s.run(call(s.scheduler.get_tenant, "logprobs")).tenant_id
    for salt in ("u1", "u2", None):
        body: dict[str, Any] = {"prompt": PROBE, "max_tokens": 1, "prompt_cache_key": "rk"}
        if salt is not None:
            body["cache_salt"] = salt
        status, got = s.post("/completions", body)
        assert status == 200, got
    keys = [k for k in s.scheduler.routing_keys.by_tenant[tenant_id] if k.endswith("/rk")]
    assert len(keys) == 3, keys
