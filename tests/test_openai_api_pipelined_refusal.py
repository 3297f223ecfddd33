"""A malformed request pipelined behind a valid one the app still serves: the valid one is never
answered with the connection's 400 (``protocol.Guarded.send_400_response``), with either of
uvicorn's parsers.

Regression (s41 review r7 of dadad26): httptools parses the bytes pipelined behind a request
whose response has not started, and the connection's 400 was written at once: the client,
pairing responses with requests in order, read "malformed HTTP request" as the answer to its
valid first request.
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI

from services.openai_api.server import HttpServer

MALFORMED = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Foo: a\x00b\r\n\r\n"
"""A request whose header value holds NUL: both parsers refuse it."""


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/wait")
    async def wait() -> dict[str, bool]:
        await asyncio.sleep(0.3)  # the malformed bytes behind it are parsed meanwhile
        return {"ok": True}

    return app


async def _answers(http: str, request: bytes) -> bytes:
    """Every byte the server sends on one connection given ``request``'s bytes at once."""
    server = HttpServer(_app(), http=http)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        data = b""
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), 5.0):
                data += chunk
        except ConnectionResetError:
            pass
        writer.close()
        return data
    finally:
        await server.stop()


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_malformed_request_behind_a_valid_one_is_not_its_answer(http: str) -> None:
    data = asyncio.run(_answers(http, b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n" + MALFORMED))
    # the first answer is the valid request's 200 (h11 parses the next request only then),
    # or none at all (httptools: the connection closes; its client sees no response)
    assert data == b"" or data.startswith(b"HTTP/1.1 200 "), data[:300]
    if data:
        assert data.count(b"HTTP/1.1 400 ") == 1 and b'"code": "invalid_argument"' in data, data[-400:]


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_malformed_first_request_still_gets_the_400_in_openai_shape(http: str) -> None:
    data = asyncio.run(_answers(http, MALFORMED))
    assert data.startswith(b"HTTP/1.1 400 ") and b'"code": "invalid_argument"' in data, data[:400]
