"""The gateway's gRPC server ends the calls of a client that stopped answering within
``keepalive_time_s + keepalive_timeout_s`` (``GrpcLimits.server_options``).

Regression (s38): the server options set ``grpc.keepalive_timeout_ms`` alone, but grpc core
(1.85) waits ``grpc.http2.ping_timeout_ms`` (60 s by default) for a keepalive ping's ack, so a
vanished client's stream (holding one of its tenant's ``max_streams_per_tenant`` calls and a
connection slot) ran on for ``keepalive_time_s`` + 60 s, whatever ``grpc_keepalive_timeout_s``
said (measured: 61.0 s with both set to 1 s).

The real ``GrpcLimits.server_options`` on a grpc server whose Generate stand-in streams one
event and then waits for its call to end; the client is a child process the test stops with
SIGSTOP once it has the event (the kernel keeps its connection open; nothing answers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services.grpc_bounds import GrpcLimits

KEEPALIVE_S = 1.0
ENDED_WITHIN_S = 15.0
"""The call must end this soon after its client stops (1 s of silence, a 1-s ping wait, on a
loaded 2-core host); before, 61 s."""

CLIENT = """
import sys, grpc
from kvstrata.v1 import inference_pb2, inference_pb2_grpc
channel = grpc.insecure_channel(sys.argv[1])
for _ in inference_pb2_grpc.InferenceServiceStub(channel).Generate(inference_pb2.GenerateRequest()):
    print("got", flush=True)
"""


class _Inference(inference_pb2_grpc.InferenceServiceServicer):
    """Streams one event, then waits until its call ends; ``ended`` set then."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def Generate(self, request, context):
        context.add_callback(self.ended.set)
        yield inference_pb2.GenerateResponse(delta=inference_pb2.GenerateDelta(text="first "))
        while context.is_active():
            time.sleep(0.05)


def test_a_stopped_clients_stream_ends_within_the_keepalive_bounds() -> None:
    limits = GrpcLimits(keepalive_time_s=KEEPALIVE_S, keepalive_timeout_s=KEEPALIVE_S, min_ping_interval_s=0.1)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=limits.server_options(16))
    servicer = _Inference()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert client.stdout.readline().strip() == "got"
        client.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert servicer.ended.wait(ENDED_WITHIN_S), f"the stream still runs {ENDED_WITHIN_S:g} s after its client stopped"
        assert time.monotonic() - stopped >= KEEPALIVE_S  # ended by the keepalive, not at once
    finally:
        client.kill()
        client.wait(10)
        server.stop(0)
