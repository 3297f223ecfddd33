"""Every HTTP generation request is counted once in ``kvstrata:requests_total``, the ones the
edge refuses before the gateway's request path included (``OpenAIEdge.count_refusal``), on
the real call path without Ray (``tests.test_openai_api_disconnect.Edge``: a real CacheNode,
the scheduler, the gateway's ``InferenceServicer`` with its real ``Authenticator``, uvicorn).

Regression: requests_total counted only requests past the edge, so a tenant's malformed,
oversized or wrong-model requests (and every request with a bad key) were counted nowhere:
the series summed to fewer requests than the clients sent."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from services.openai_api.bodies import MAX_BODY_BYTES
from tests.test_openai_api_disconnect import Edge


@pytest.fixture(scope="module")
def edge() -> Iterator[Edge]:
    e = Edge()
    yield e
    e.close()


def _status(edge: Edge, body: bytes, key: str, length: int | None = None) -> int:
    """POST ``body`` to ``/v1/completions`` with ``key`` on a new connection; the status code."""
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (key.encode(), len(body) if length is None else length, body))
        head = b""
        while b"\r\n" not in head:
            head += sock.recv(4096)
        return int(head.split()[1])


def _counts(edge: Edge) -> dict[tuple[str, str], float]:
    """(tenant, status) -> requests_total, as a scrape of the gateway's registry reads it."""
    return {(s.labels["tenant"], s.labels["status"]): s.value
            for family in edge.servicer.metrics.registry.collect() if family.name == "kvstrata:requests"
            for s in family.samples if s.name == "kvstrata:requests_total"}


def test_edge_refusals_are_counted_once_by_status(edge: Edge) -> None:
    """A bad key (401: tenant ""), malformed JSON and an invalid field (400), an unknown model
    (404) and an oversized body (413) each count once, under the tenant and the gRPC status
    name the gRPC API gives the same refusal; a request the gateway's path refuses (a prompt
    past the context: 400) and one served (200) count once each, there. The counts grow by
    exactly the 7 requests sent."""
    model = edge.model
    before = _counts(edge)
    sent = [
        (b'{"model": "%s", "prompt": [5], "max_tokens": 2}' % model.encode(), "sk-not-a-key", None, 401),
        (b'{"model": ', edge.key, None, 400),
        (b'{"model": "%s", "prompt": [5], "max_tokens": -1}' % model.encode(), edge.key, None, 400),
        (b'{"model": "nope", "prompt": [5], "max_tokens": 2}', edge.key, None, 404),
        (b"{}", edge.key, MAX_BODY_BYTES + 1, 413),
        (json.dumps({"model": model, "prompt": [5] * 5000, "max_tokens": 2}).encode(), edge.key, None, 400),
        (b'{"model": "%s", "prompt": [5], "max_tokens": 2}' % model.encode(), edge.key, None, 200),
    ]
    assert [_status(edge, body, key, length) for body, key, length, _ in sent] == [s for *_, s in sent]
    after = _counts(edge)
    grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert grown == {("", "UNAUTHENTICATED"): 1, ("hangup", "INVALID_ARGUMENT"): 3, ("hangup", "NOT_FOUND"): 1,
                     ("hangup", "RESOURCE_EXHAUSTED"): 1, ("hangup", "OK"): 1}
