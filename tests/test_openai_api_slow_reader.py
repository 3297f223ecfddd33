"""A client that reads its stream slowly, on the real call path without Ray: a real CacheNode
(the tiny Llama), the GlobalScheduler's admission server, the gateway's ``InferenceServicer``
and the OpenAI app served by uvicorn (``tests.test_openai_api_disconnect.Edge``), the client a
raw socket that reads a few bytes at a time.

What such a client holds, measured on this setup (before the fix): not its request's engine
slot or KV blocks, since the node runs a request to its end whatever its client reads (1,400
tokens in ~11-12 s with a reader taking 1 byte/s, its ~89 blocks freed at the end), nor beyond
``max_undelivered_bytes`` of its events at the gateway; but its connection, its tenant's
stream (``max_streams_per_tenant``), the undelivered events and the transport's and kernel's
buffers, for as long as it trickles: a stream was exempt from the send-stall deadline and left
to ``stream_idle_timeout_s`` (300 s between two events taken), so ~160 bytes/s held a stream of
megabytes for hours. Now the connection's minimum read rate (``min_send_rate_bytes_per_s``)
applies to streams: a reader falling ``send_stall_timeout_s`` behind it while it holds the
writes up is cut off, and its request is aborted on its node at once."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.connections import ConnectionLimits
from services.openai_api.server import HttpServer
from tests.loop_plane import wait_for
from tests.test_openai_api_disconnect import Edge

LIMITS = ConnectionLimits(send_stall_timeout_s=1.0, min_send_rate_bytes_per_s=4096, send_buffer_bytes=4096)
"""A reader must take 4 KiB/s of what it holds up, and may fall 1 s behind; small kernel
buffers, so that the tiny model's stream is held up within seconds."""


class SlowEdge(Edge):
    """``Edge`` with a second HTTP server under ``LIMITS``."""

    def __init__(self) -> None:
        super().__init__()
        info = self.node.describe()
        self.slow = HttpServer(create_app(OpenAIEdge(self.servicer, info["model_id"], list, lambda: 1)), limits=LIMITS)
        self.slow_port = self.run(self.slow.start("127.0.0.1", 0))

    async def close_gateways(self) -> None:
        await self.slow.stop()
        await super().close_gateways()

    def stream(self, max_tokens: int) -> socket.socket:
        """A streamed completion of ``max_tokens`` (EOS ignored) on a new connection to ``slow``,
        with a 4 KiB receive buffer; its reply unread."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", self.slow_port))
        data = json.dumps({"model": self.model, "prompt": [5] * 20, "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True, "logprobs": 5})
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.key}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n{data}").encode())
        return sock

    def used_blocks(self) -> int:
        return int(self.node.stats()["used_blocks"])

    def requests(self, status: str) -> float:
        value = self.servicer.metrics.registry.get_sample_value("kvstrata:requests_total",
                                                                {"tenant": "hangup", "status": status})
        return value or 0.0


@pytest.fixture(scope="module")
def edge() -> Iterator[SlowEdge]:
    e = SlowEdge()
    yield e
    e.close()


def trickle(sock: socket.socket, bytes_per_s: float, until_s: float, done: Any = None) -> tuple[bytes, bool, float]:
    """Read ``sock`` at ``bytes_per_s`` (a slice every 50 ms) for ``until_s``, until the server
    ends the connection or ``done(received)``; (what was read, whether the connection was
    reset, seconds taken)."""
    got, start, ahead = bytearray(), time.monotonic(), 0.0
    sock.settimeout(0.05)
    while time.monotonic() - start < until_s and not (done and done(got)):
        time.sleep(0.05)
        ahead += bytes_per_s * 0.05
        while ahead >= 1:
            try:
                data = sock.recv(int(ahead))
            except TimeoutError:
                break
            except ConnectionResetError:
                return bytes(got), True, time.monotonic() - start
            if not data:
                return bytes(got), False, time.monotonic() - start
            got += data
            ahead -= len(data)
    return bytes(got), False, time.monotonic() - start


def test_a_trickle_reader_is_cut_off_and_its_request_aborted(edge: SlowEdge) -> None:
    """Regression (a trickle reader holding a stream): the client takes 1 KiB/s of a stream of
    1,400 tokens (~1 MB of events with their logprobs). Once the stream's writes are held up
    it falls 0.75 s behind the 4 KiB/s minimum per second, and is cut off (reset) about 1.3 s
    later: its request is aborted on its node mid-generation (its blocks freed well before
    the ~11 s its 1,400 tokens take), counted CANCELLED, and its tenant's stream released.
    Before, the stream was exempt from the send-stall rule: the connection stayed open (the
    request ran to its end and the reader held the rest for ~15 minutes)."""
    cancelled = edge.requests("CANCELLED")
    sock = edge.stream(1400)
    try:
        wait_for(lambda: edge.used_blocks() > 0, 10.0)
        got, reset, took = trickle(sock, 1024, 30.0)
        assert reset, (len(got), took)
        assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
        assert took < 10.0, took
        tokens_left = wait_for(lambda: edge.used_blocks() == 0 and edge.stats() == (0, 0), 3.0)
        assert tokens_left < 3.0
        wait_for(lambda: edge.servicer.open_streams == {}, 3.0)
        wait_for(lambda: edge.requests("CANCELLED") == cancelled + 1, 3.0)
        assert edge.requests("OK") == 0
        assert edge.slow.guard is not None and edge.slow.guard.stats["send_stalled"] == 1
    finally:
        sock.close()


def test_a_reader_above_the_minimum_rate_gets_its_whole_stream(edge: SlowEdge) -> None:
    """A client holding the stream's writes up (the node writes ~50 KB/s) but taking 24 KiB/s
    (6 times the minimum) reads its whole stream, to ``[DONE]``, uncut."""
    ok, stalled = edge.requests("OK"), edge.slow.guard.stats["send_stalled"]  # type: ignore[union-attr]
    sock = edge.stream(200)
    end = b"data: [DONE]\n\n\r\n0\r\n\r\n"
    try:
        got, reset, took = trickle(sock, 24 << 10, 60.0, lambda got: got.endswith(end))
        assert not reset and got.endswith(end), (len(got), took)
        assert len(got) > 64 << 10  # more than the transport buffers before it holds writes up
        assert edge.slow.guard.stats["send_stalled"] == stalled  # type: ignore[union-attr]
        wait_for(lambda: edge.requests("OK") == ok + 1, 3.0)
    finally:
        sock.close()
