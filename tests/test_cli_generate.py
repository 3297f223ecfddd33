"""``kvstrata generate`` explains how a request ended and handles Ctrl-C; ``kvstrata tenant
show`` prints a table (issue 21: the finish reason ``stop:``/``length:`` was unexplained;
Ctrl-C left the line unterminated with no note and the call running; ``tenant show``
printed raw protobuf text)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from cli import main as cli
from cli.generate import CANCELLED_EXIT_CODE, FINISH_REASONS, finish_line
from kvstrata.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tenants.model import TenantSpec
from tests.gateway_harness import serve

ROOT = Path(__file__).resolve().parent.parent
# `python -m cli.main`, with Ctrl-C's default handler restored first: a process started from a
# non-interactive shell's background job (`cmd &`, as CI runners may start the suite) inherits
# SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so the test's SIGINT
# would never reach the CLI (a terminal's Ctrl-C reaches a foreground command with the default)
CLI_WITH_CTRL_C = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "runpy.run_module('cli.main', run_name='__main__', alter_sys=True)")


class SlowInference(inference_pb2_grpc.InferenceServiceServicer):
    """Streams ``word `` every 50 ms (no newline) until the client cancels; records that."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.started = threading.Event()

    def Generate(self, request, context):
        context.add_callback(lambda: self.cancelled.set() if not context.is_active() else None)
        self.started.set()
        for _ in range(2000):  # 100 s: far past the test
            yield inference_pb2.GenerateResponse(delta=inference_pb2.GenerateDelta(text="word "))
            time.sleep(0.05)


@pytest.fixture()
def slow_gateway() -> Iterator[tuple[str, SlowInference]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = SlowInference()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("reason,meaning", [("stop", "the model ended its answer"),
                                            ("length", "max_tokens reached")])
def test_finish_line_explains_the_reason(reason: str, meaning: str) -> None:
    finished = inference_pb2.GenerateFinished(
        finish_reason=reason, prompt_tokens=12, completion_tokens=5, ttft_ms=80.4, tpot_ms=21.6,
        cached_tokens=common_pb2.TierTokens(device=8))
    line = finish_line(finished)
    assert line.startswith(f"{reason}: {meaning}")
    assert "12 prompt tokens (8 cached on the device), 5 generated, TTFT 80 ms, TPOT 22 ms" in line
    assert set(FINISH_REASONS) == {"stop", "length", "abort", "tool_calls"}  # GenerateFinished's documented reasons


def test_ctrl_c_ends_the_line_says_cancelled_and_cancels_the_call(slow_gateway) -> None:
    """SIGINT to a real ``kvstrata generate`` process mid-stream: the text line is ended, a note
    says the request was cancelled, the exit code is 130 and the server sees the call cancelled."""
    address, servicer = slow_gateway
    env = {**os.environ, "KVSTRATA_API_KEY": "kvs_0123456789ab_" + "A" * 43, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-c", CLI_WITH_CTRL_C, "generate", "hi", "--gateway", address],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert servicer.started.wait(60), "the CLI never called the server"
        time.sleep(0.5)  # some words printed
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == CANCELLED_EXIT_CODE, output
    text, _, rest = output.partition("\n")
    assert text.startswith("word word ") and "cancelled" not in text, output
    assert "cancelled (Ctrl-C): the request was cancelled" in rest, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert servicer.cancelled.wait(10), "the gRPC call was not cancelled"


def test_tenant_show_is_a_table(tmp_path: Path) -> None:
    with serve(tmp_path) as gw:
        gw.scheduler.store.register(TenantSpec("ann", "interactive", ttft_slo_ms=800.0,
                                               cache_namespace="wiki"))
        result = CliRunner().invoke(cli.app, ["tenant", "show", "ann", "--gateway", gw.address],
                                    env={"KVSTRATA_ADMIN_KEY": gw.admin_key, "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = {}
    for line in result.output.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    assert rows["SLO class"] == "interactive"
    assert rows["TTFT target (ms)"] == "800"
    assert rows["cache namespace"] == "wiki"
    assert rows["requests"] == "0"
    assert "tenant_id:" not in result.output and "spec {" not in result.output  # no protobuf text


class RecordingInference(inference_pb2_grpc.InferenceServiceServicer):
    """Keeps the request it gets and ends it at once (finish reason stop)."""

    def __init__(self) -> None:
        self.requests: list[inference_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        yield inference_pb2.GenerateResponse(delta=inference_pb2.GenerateDelta(text="ok"))
        yield inference_pb2.GenerateResponse(finished=inference_pb2.GenerateFinished(finish_reason="stop"))



class ToolCallingInference(RecordingInference):
    """Keeps the request it gets and answers with one tool call (finish reason tool_calls)."""

    def Generate(self, request, context):
        self.requests.append(request)
        call = inference_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
        yield inference_pb2.GenerateResponse(finished=inference_pb2.GenerateFinished(
            finish_reason="tool_calls", tool_calls=[call]))


def test_the_tool_results_hint_runs_as_printed_for_any_session_id(tmp_path: Path) -> None:
    """After a reply's tool calls, ``generate`` prints the command that sends the results
    back. Run as printed (its ``--tools ...`` given a file), it continues the same session under
    the same salt, for a session id and a salt with a space and a quote. Regression (s37 review
    r3): the salt was shell-quoted, the session id not: ``--session my s'1`` split into two
    words, so the command sent another session id (or a shell refused the quote)."""
    session, salt = "my s'1", "u 1"
    (tmp_path / "tools.json").write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))
    server, servicer = grpc.server(futures.ThreadPoolExecutor(max_workers=2)), ToolCallingInference()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"KVSTRATA_API_KEY": "k", "COLUMNS": "1000"}
    gateway = ["--gateway", f"127.0.0.1:{port}"]
    try:
        first = CliRunner().invoke(cli.app, ["generate", "Weather in Paris?", "--session", session, "--cache-salt",
                                             salt, "--tools", f"@{tmp_path / 'tools.json'}", *gateway], env=env)
        assert first.exit_code == 0, first.output
        [hint] = [line for line in first.output.splitlines() if line.startswith("send each result back with: ")]
        command, _, note = hint.removeprefix("send each result back with: ").partition(" (ID=@FILE")
        assert note, hint  # (the command, then a note on --tool-result's form)
        argv = shlex.split(command)
        assert argv[:2] == ["kvstrata", "generate"], argv
        argv[argv.index("...")] = f"@{tmp_path / 'tools.json'}"
        second = CliRunner().invoke(cli.app, [*argv[1:], *gateway], env=env)
    finally:
        server.stop(grace=None)
    assert second.exit_code == 0, second.output
    [_, sent] = servicer.requests
    assert (sent.session_id, sent.cache_salt) == (session, salt)
    assert [(m.role, m.tool_call_id, m.content) for m in sent.chat.messages] == [("tool", "ID", "RESULT")]

def test_generate_sends_priority_and_stop_strings() -> None:
    """H11 trial: `generate` had no --priority or --stop although the gRPC API takes both; they
    now travel in GenerateRequest.priority and SamplingParams.stop (--stop repeatable)."""
    server, servicer = grpc.server(futures.ThreadPoolExecutor(max_workers=2)), RecordingInference()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = CliRunner().invoke(cli.app, ["generate", "hi", "--priority", "-7", "--stop", "END", "--stop",
                                              "\n\n", "--gateway", f"127.0.0.1:{port}"],
                                    env={"KVSTRATA_API_KEY": "k"})
        plain = CliRunner().invoke(cli.app, ["generate", "hi", "--gateway", f"127.0.0.1:{port}"],
                                   env={"KVSTRATA_API_KEY": "k"})
    finally:
        server.stop(grace=None)
    assert result.exit_code == 0 and plain.exit_code == 0, result.output + plain.output
    sent, default = servicer.requests
    assert sent.priority == -7 and list(sent.sampling.stop) == ["END", "\n\n"]
    assert default.priority == 0 and list(default.sampling.stop) == [] and default.sampling.temperature == 0


@pytest.mark.parametrize(("value", "exit_code"), [("2", 0), ("2.5", 2), ("5", 2), ("-0.1", 2)])
def test_generate_bounds_temperature_as_the_server_does(value: str, exit_code: int) -> None:
    """Review 25b N2: ``--temperature`` took 0..100 while the server takes [0, 2]
    (``MAX_REQUEST_TEMPERATURE``): ``--temperature 5`` reached the server and exited 1 with its
    INVALID_ARGUMENT. Now it is a usage error (exit 2) before any call; 2 itself is sent."""
    server, servicer = grpc.server(futures.ThreadPoolExecutor(max_workers=2)), RecordingInference()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = CliRunner().invoke(cli.app, ["generate", "hi", "--temperature", value, "--gateway",
                                              f"127.0.0.1:{port}"], env={"KVSTRATA_API_KEY": "k"})
    finally:
        server.stop(grace=None)
    assert result.exit_code == exit_code, result.output
    assert [r.sampling.temperature for r in servicer.requests] == ([float(value)] if exit_code == 0 else [])


def test_a_stop_finish_with_stop_strings_does_not_claim_the_model_ended_it() -> None:
    """A fresh-user trial: `generate ... --stop 5` cut at the stop string ended with "stop: the
    model ended its answer." GenerateFinished says `stop` both when the model ended its answer
    and when a stop string matched (nothing else tells them apart), so with --stop the line
    names both; without --stop only the model can have ended it."""
    finished = inference_pb2.GenerateFinished(finish_reason="stop", completion_tokens=9)
    assert finish_line(finished).startswith("stop: the model ended its answer. ")
    assert finish_line(finished, ["5"]).startswith("stop: the model ended its answer or a --stop string matched. ")
    length = inference_pb2.GenerateFinished(finish_reason="length")
    assert finish_line(length, ["5"]).startswith("length: max_tokens reached")  # only `stop` is ambiguous
    server, servicer = grpc.server(futures.ThreadPoolExecutor(max_workers=2)), RecordingInference()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        outputs = [CliRunner().invoke(cli.app, ["generate", "Count to 10", *extra, "--gateway", f"127.0.0.1:{port}"],
                                      env={"KVSTRATA_API_KEY": "k", "COLUMNS": "1000"})
                   for extra in (["--stop", "5"], [])]
    finally:
        server.stop(grace=None)
    assert all(r.exit_code == 0 for r in outputs), [r.output for r in outputs]
    stopped, plain = (r.output.splitlines()[-1] for r in outputs)
    assert stopped.startswith("stop: the model ended its answer or a --stop string matched."), stopped
    assert plain.startswith("stop: the model ended its answer."), plain


def _table_rows(output: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("│┃ ").split("│" if "│" in line else "┃")]
            for line in output.splitlines() if "│" in line or "┃" in line]


def test_tenant_list_is_worded_as_tenant_show(tmp_path: Path) -> None:
    """H11 trial: `tenant list` had snake_case headers (ttft_slo_ms, min_tokens_per_s) where
    `tenant show` says "TTFT target (ms)", and no TPOT target although its help promises the
    targets; it now has show's headers and wording, both targets included."""
    with serve(tmp_path) as gw:
        gw.scheduler.store.register(TenantSpec("ann", "interactive", ttft_slo_ms=800.0, tpot_slo_ms=90.0))
        gw.scheduler.store.register(TenantSpec("bob"))
        result = CliRunner().invoke(cli.app, ["tenant", "list", "--gateway", gw.address],
                                    env={"KVSTRATA_ADMIN_KEY": gw.admin_key, "COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    header, *rows = _table_rows(result.output)
    assert header == ["name", "SLO class", "TTFT target (ms)", "TPOT target (ms)", "floor (tokens/s)", "weight",
                      "cache namespace", "KV policy"]
    by_name = {row[0]: dict(zip(header, row)) for row in rows}
    assert by_name["ann"]["TTFT target (ms)"] == "800" and by_name["ann"]["TPOT target (ms)"] == "90"
    assert by_name["bob"]["SLO class"] == "standard" and by_name["bob"]["cache namespace"] == "own"
    assert "ttft_slo_ms" not in result.output


class ClosingInference(inference_pb2_grpc.InferenceServiceServicer):
    """Closes session "s1" of the tenant with key "k" (42 tokens); NOT_FOUND otherwise."""

    def CloseSession(self, request, context):
        if dict(context.invocation_metadata()).get("authorization") != "Bearer k" or request.session_id != "s1":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r} for this tenant")
        return inference_pb2.CloseSessionResponse(freed_tokens=42)


def test_close_session_frees_a_session_from_the_cli() -> None:
    """A fresh-user trial found no CLI way to close a session (only gRPC CloseSession and
    HTTP DELETE /v1/sessions/{id}); `kvstrata close-session ID` calls CloseSession."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(ClosingInference(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        args = ["close-session", "--gateway", f"127.0.0.1:{port}"]
        done = CliRunner().invoke(cli.app, [*args, "s1"], env={"KVSTRATA_API_KEY": "k"})
        assert done.exit_code == 0 and "closed session s1: 42 tokens of history freed" in done.output
        missing = CliRunner().invoke(cli.app, [*args, "s2"], env={"KVSTRATA_API_KEY": "k"})
        assert missing.exit_code == 1 and "NOT_FOUND" in missing.output and "s2" in missing.output
    finally:
        server.stop(0)


def test_an_answer_the_server_aborted_exits_1() -> None:
    """A fresh-user trial: a request cut off by an admin Drain printed its `abort:` line and
    exited 0, as a finished answer does; a script could not tell them apart."""
    import io

    import typer as typer_mod

    from cli.generate import stream_to

    def events(reason: str):  # type: ignore[no-untyped-def]
        yield inference_pb2.GenerateResponse(delta=inference_pb2.GenerateDelta(text="partial"))
        yield inference_pb2.GenerateResponse(finished=inference_pb2.GenerateFinished(finish_reason=reason))

    with pytest.raises(typer_mod.Exit) as exited:
        stream_to(events("abort"), io.StringIO())
    assert exited.value.exit_code == 1
    stream_to(events("length"), io.StringIO())  # a finished answer returns: exit 0


def test_admin_flush_and_drain_from_the_cli(tmp_path: Path) -> None:
    """A fresh-user trial found Flush and Drain over gRPC only; `kvstrata admin flush` and
    `admin drain` call them with the admin key (no node behind this gateway: nothing freed)."""
    with serve(tmp_path) as gw:
        env = {"KVSTRATA_ADMIN_KEY": gw.admin_key, "COLUMNS": "200"}
        flushed = CliRunner().invoke(cli.app, ["admin", "flush", "--gateway", gw.address], env=env)
        drained = CliRunner().invoke(cli.app, ["admin", "drain", "--timeout-s", "0", "--gateway", gw.address], env=env)
        refused = CliRunner().invoke(cli.app, ["admin", "flush", "--gateway", gw.address],
                                     env={**env, "KVSTRATA_ADMIN_KEY": "kvs_000000000000_" + "x" * 43})
    assert flushed.exit_code == 0 and "flushed: 0 KV blocks freed, all tiers: 0 cached on the device tier" in flushed.output
    assert drained.exit_code == 0 and "drained: 0 requests aborted" in drained.output
    assert refused.exit_code == 1 and "UNAUTHENTICATED" in refused.output


def test_tenant_update_changes_only_the_given_settings(tmp_path: Path) -> None:
    """A fresh-user trial found no CLI way to change a tenant (gRPC UpdateTenant replaces the
    whole spec, unset fields taking their class defaults); `tenant update` changes what it is
    given and keeps the rest, keys included."""
    with serve(tmp_path) as gw:
        _, key = gw.scheduler.store.register(TenantSpec("ann", "interactive", ttft_slo_ms=800.0, policy="snapkv-0.5"))
        env = {"KVSTRATA_ADMIN_KEY": gw.admin_key, "COLUMNS": "200"}
        done = CliRunner().invoke(cli.app, ["tenant", "update", "ann", "--weight", "3", "--allow-policy", "snapkv",
                                            "--gateway", gw.address], env=env)
        missing = CliRunner().invoke(cli.app, ["tenant", "update", "nobody", "--weight", "3",
                                               "--gateway", gw.address], env=env)
        spec = gw.scheduler.store.get("ann").spec
        assert gw.scheduler.store.authenticate(key) is not None
    assert done.exit_code == 0, done.output
    assert "updated ann: weight, allowed_policies" in done.output
    assert (spec.slo_class.value, spec.ttft_slo_ms, spec.policy, spec.weight, spec.allowed_policies) == (
        "interactive", 800.0, "snapkv-0.5", 3.0, ("snapkv",))
    assert missing.exit_code == 1 and "NOT_FOUND" in missing.output
