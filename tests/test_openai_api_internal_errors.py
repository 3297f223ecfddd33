"""An exception no check turned into a status (a bug) on the OpenAI API: a 500 in OpenAI's
error shape (``internal_error``) with an incident id, the exception's text and class only in
the server's log, through the real ``HttpServer``. Regression: Starlette's plain-text
"Internal Server Error", which client libraries cannot read as an OpenAI error."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from typing import Any

import pytest

from services.openai_api import HttpServer, create_app


def _post(edge: Any, times: int = 1) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Status, headers and JSON body of ``POST /v1/completions`` to a real ``HttpServer`` over
    ``edge``, sent ``times`` times (each must be an error; the first one's answer)."""
    async def run() -> tuple[int, dict[str, Any], dict[str, Any]]:
        server = HttpServer(create_app(edge))
        port = await server.start("127.0.0.1", 0)
        try:
            def post() -> tuple[int, dict[str, Any], dict[str, Any]]:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", b"{}",
                                             {"Content-Type": "application/json"})
                try:
                    urllib.request.urlopen(req, timeout=30)
                except urllib.error.HTTPError as err:
                    return err.code, dict(err.headers), json.loads(err.read())
                raise AssertionError("no error")
            answers = [await asyncio.to_thread(post) for _ in range(times)]
            assert len({a[0] for a in answers}) == 1, answers  # the server goes on as it did
            return answers[0]
        finally:
            await server.stop()

    return asyncio.run(run())


class _Counting:
    """An edge's ``count_refusal``: the refusals the route counted (``OpenAIEdge.count_refusal``)."""

    def __init__(self) -> None:
        self.refused: list[BaseException] = []

    def count_refusal(self, request: Any, exc: BaseException) -> None:
        self.refused.append(exc)


class _Failing(_Counting):
    """An edge whose every parse fails as a bug would."""

    async def parse(self, request: Any, model: Any) -> Any:
        raise RuntimeError("secret detail /srv/kvstrata/state")

    async def complete(self, request: Any, body: Any) -> Any:  # (the route names it first)
        raise AssertionError("never reached: parse failed")


def test_an_unexpected_exception_is_an_openai_500_with_an_incident_id(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="services.openai_api.app"):
        status, headers, body = _post(_Failing(), times=2)
    assert status == 500 and headers["content-type"].startswith("application/json"), (status, headers)
    error = body["error"]
    assert error["type"] == "internal_error" and error["message"].startswith("internal error (incident "), body
    assert "secret" not in json.dumps(body) and "RuntimeError" not in json.dumps(body)
    incident = error["message"].split("incident ", 1)[1].split(")", 1)[0]
    logged = [r for r in caplog.records if incident in r.getMessage() and r.exc_info]
    assert logged and "secret detail" in str(logged[0].exc_info[1]), caplog.records  # the bug itself


class _SchedulerSilent(_Counting):
    """An edge whose parse meets a scheduler that did not answer in time."""

    async def parse(self, request: Any, model: Any) -> Any:
        from services.actor_calls import ActorSilent

        raise ActorSilent("the global scheduler did not answer in 30 s")

    async def complete(self, request: Any, body: Any) -> Any:
        raise AssertionError("never reached: parse failed")


def test_a_silent_scheduler_is_a_503_with_retry_after() -> None:
    """Review 29a F2: the HTTP API's calls whose key the gateway had not cached waited for a
    stopped scheduler with no bound; past the gateway's deadline they are a 503 with
    ``Retry-After``, as the gRPC API's UNAVAILABLE."""
    edge = _SchedulerSilent()
    status, headers, body = _post(edge)
    assert status == 503 and headers.get("retry-after") == "1", (status, headers, body)
    assert [type(exc).__name__ for exc in edge.refused] == ["ActorSilent"]  # counted once, by the route
    assert "did not answer" in body["error"]["message"], body
