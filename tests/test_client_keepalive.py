"""Our clients' channels ping a gateway that has gone silent while a call is open, so a stream
without a deadline ends UNAVAILABLE instead of waiting forever
(``services.grpc_messages.client_channel_options``).

Regression (s38): ``kvstrata generate`` (as the workload's and the benchmarks' Generate calls)
opened its channel without keepalive and its stream without a deadline: against a gateway
whose process was stopped after the first token (as a host gone without a word, or a dropped
network path, looks to a client), it waited forever.

The real CLI command (``kvstrata generate``, in this process, its keepalive shortened to 1 s)
against a gateway stand-in in a child process (it streams one token, then nothing) that the
test stops with SIGSTOP: the kernel still holds the connection open, and nothing answers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from cli import main as cli
from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services import grpc_messages
from services.grpc_bounds import GrpcLimits

GATEWAY = """
    import sys, time
    from concurrent import futures
    import grpc
    from kvstrata.v1 import inference_pb2, inference_pb2_grpc

    class Inference(inference_pb2_grpc.InferenceServiceServicer):
        def Generate(self, request, context):
            yield inference_pb2.GenerateResponse(delta=inference_pb2.GenerateDelta(text="first "))
            print("streamed", flush=True)
            time.sleep(3600)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[
        ("grpc.http2.min_ping_interval_without_data_ms", 100), ("grpc.http2.max_ping_strikes", 0)])
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(Inference(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    server.wait_for_termination()
"""

ENDED_WITHIN_S = 20.0
"""The CLI's stream must end this soon after the gateway stops (1 s of silence, a 1-s ping
wait, on a loaded 2-core host); before, it never ended."""


def test_generate_ends_unavailable_when_the_gateway_stops_answering(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "gateway.py"
    script.write_text(textwrap.dedent(GATEWAY))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    gateway = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    monkeypatch.setattr("services.grpc_messages.CLIENT_KEEPALIVE_S", 1.0, raising=False)
    monkeypatch.setattr("services.grpc_messages.CLIENT_KEEPALIVE_TIMEOUT_S", 1.0, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no saved `kvstrata up` state (plaintext)
    result: list = []
    try:
        port = int(gateway.stdout.readline())
        runner = threading.Thread(target=lambda: result.append(CliRunner().invoke(cli.app, [
            "generate", "hi", "--gateway", f"127.0.0.1:{port}", "--api-key", "ks_test"])), daemon=True)
        runner.start()
        assert gateway.stdout.readline().strip() == "streamed"
        gateway.send_signal(signal.SIGSTOP)
        runner.join(ENDED_WITHIN_S)
        if runner.is_alive():
            pytest.fail(f"kvstrata generate still waits {ENDED_WITHIN_S:g} s after its gateway stopped answering")
    finally:
        gateway.kill()  # (a stopped process is killed too)
        gateway.wait(10)
    out = result[0]
    assert out.exit_code == 1, out.output
    assert "first" in out.output and "UNAVAILABLE" in out.output, out.output


SCALE = 1 / 200
"""Every keepalive time below runs at this fraction of its real value (grpc core's and grpc-go's
servers allow a client's pings without data every 5 min by default: 1.5 s here)."""

GRPC_DEFAULT_MIN_PING_INTERVAL_S = 300.0
"""grpc core's ``grpc.http2.min_ping_interval_without_data_ms`` default (grpc-go's
``EnforcementPolicy.MinTime`` too): a ping sooner is a strike, and past 2 strikes without data
the server answers GOAWAY ``too_many_pings``, ending every call on the connection."""


class _PausingInference(inference_pb2_grpc.InferenceServiceServicer):
    """Streams one token, is silent ``silent_s`` (a slow tool call, a long prefill), then one more."""

    def __init__(self, silent_s: float) -> None:
        self.silent_s = silent_s

    def Generate(self, request, context):
        yield inference_pb2.GenerateResponse(delta=inference_pb2.GenerateDelta(text="first "))
        time.sleep(self.silent_s)
        yield inference_pb2.GenerateResponse(delta=inference_pb2.GenerateDelta(text="last"))


@pytest.mark.parametrize("server", ["kvstrata gateway defaults", "plain grpc server defaults"])
def test_a_silent_healthy_stream_is_not_ended_by_our_pings(server: str, monkeypatch) -> None:
    """A stream its server keeps silent ends as the server ends it: our clients' keepalive
    pings get no GOAWAY ``too_many_pings``, neither from the gateway's own server options
    (``GrpcLimits``' defaults; silent 2.5 client keepalive times, 13 min unscaled) nor from a
    grpc server with grpc's default ping policy (a user's proxy in front of the gateway; silent
    4.5 of its 5-min intervals, so that 4 pings come, past the 2 strikes it allows), all times
    scaled alike.

    Regression (s38 review): the clients pinged after 30 s of silence, 10 times as often as
    a default grpc server allows: a plain grpc server with its defaults ended a healthy stream
    silent 90 s (after a token) or 150 s (from its start) UNAVAILABLE "Too many pings"."""
    for name in ("CLIENT_KEEPALIVE_S", "CLIENT_KEEPALIVE_TIMEOUT_S"):
        monkeypatch.setattr(f"services.grpc_messages.{name}", getattr(grpc_messages, name) * SCALE)
    if server == "plain grpc server defaults":
        options = [("grpc.http2.min_ping_interval_without_data_ms", round(GRPC_DEFAULT_MIN_PING_INTERVAL_S * SCALE * 1000))]
        silent_s = 4.5 * GRPC_DEFAULT_MIN_PING_INTERVAL_S * SCALE
    else:
        default = GrpcLimits()
        limits = GrpcLimits(keepalive_time_s=default.keepalive_time_s * SCALE,
                            keepalive_timeout_s=default.keepalive_timeout_s * SCALE,
                            min_ping_interval_s=default.min_ping_interval_s * SCALE)
        options = limits.server_options(16)
        silent_s = 2.5 * grpc_messages.CLIENT_KEEPALIVE_S
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(_PausingInference(silent_s), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_messages.client_channel_options()) as channel:
            stream = inference_pb2_grpc.InferenceServiceStub(channel).Generate(inference_pb2.GenerateRequest())
            try:
                texts = [r.delta.text for r in stream]
            except grpc.RpcError as exc:
                pytest.fail(f"a healthy stream silent {silent_s:.1f} s ({server}) ended {exc.code()}: {exc.details()}")
        assert texts == ["first ", "last"]
    finally:
        grpc_server.stop(0)
