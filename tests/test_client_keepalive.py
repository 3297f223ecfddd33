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
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import main as cli

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
