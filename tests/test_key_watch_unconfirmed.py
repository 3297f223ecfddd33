"""A gateway that cannot reach the scheduler's key directory does not go on with API keys it
cannot confirm (security hardening, session 37).

The fault: a key-directory refresh that failed (an error, a timeout, a malformed reply) ended
nothing, ever. While a gateway could not reach the directory (the scheduler silent or
unreachable from it), the key watch (``services.gateway_key_watch.KeyWatch``) could not see a
key removed meanwhile, and the streams that key had opened ran on to ``max_tokens``.

Now a stream whose key was last confirmed (its opening, or the watch's last refresh that
answered) longer ago than ``key_staleness_max_s`` ends UNAVAILABLE (gRPC, with a retry hint (``retry-after-ms``);
HTTP 503, retryable) at a check whose refresh fails after the check before it failed too;
fewer failures end nothing. New calls were bounded already: a key passes from the gateway's
key cache for ``_CACHE_TTL_S`` after its check at the scheduler, then needs the scheduler, and
a silent one fails the call 503 with ``Retry-After`` (the second test guards that bound).

The real path of tests/test_stream_key_revoked.py (its ``Plane``: a real cache node with the
tiny Llama, the scheduler's admission server on the real data plane, the gateway's gRPC and
HTTP edges); the directory is made unreachable as production's gateway sees a silent
scheduler: its handle is a real ``BoundedActor`` whose ``silent`` names why (as
``NodeMonitor.scheduler_silence`` sets it), so its calls fail ``ActorSilent`` unsent.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import grpc

from services.actor_calls import BoundedActor
from services.auth import _CACHE_TTL_S
from services.gateway_key_watch import STALE_MESSAGE
from tests.loop_plane import Actor, call, wait_for
from tests.test_stream_key_revoked import Plane, _sse_error, plane  # noqa: F401 - the fixture

CHECK_S = 0.5
"""The key watch's interval here (``KEY_CHECK_S`` is 5 s)."""
STALENESS_MAX_S = 3.0
"""``key_staleness_max_s`` here (120 s by default)."""


def _silent_scheduler(p: Plane) -> BoundedActor:
    """The scheduler's handle as a gateway holds it once its monitor found it silent."""
    handle = BoundedActor(Actor(p.scheduler), 30.0)
    handle.silent = lambda: "the global scheduler has not answered its health checks for 10 s"
    return handle


def _get_models(p: Plane, key: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """GET /v1/models with ``key``: (status, headers (lower-case names), JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", p.http_port, timeout=30)
    try:
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        reply = conn.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, json.loads(reply.read())
    finally:
        conn.close()


def test_streams_end_unavailable_once_their_keys_go_unconfirmed_past_the_bound(plane: Plane) -> None:  # noqa: F811
    """ann (gRPC) and bob (a whole and a streamed HTTP completion) stream; the directory stops answering, and
    ann's key is rotated away at another gateway, which this one cannot see. Before the bound
    (several failed refreshes) the streams run on; past it all end UNAVAILABLE (HTTP 503
    ``service_unavailable``, an SSE error event of that type), leave the node and are released. Once the directory answers
    again, ann's stream under her new key runs on. Old code: all ran on to ``max_tokens``
    (ann's, ~20 s here, not ended within 10 s)."""
    watch = plane.watch
    watch.interval_s, watch.staleness_max_s = CHECK_S, STALENESS_MAX_S
    watch.keys_gone(None)  # (a check now: the next one waits CHECK_S)
    ann, ann_key = plane.register("ann")
    bob, bob_key = plane.register("bob")
    anns, bobs = plane.grpc_stream(ann_key), plane.http_completion(bob_key, False)
    bobs_sse = plane.http_completion(bob_key, True)
    wait_for(lambda: plane.node_streams() == {ann: 1, bob: 2}, 30)
    time.sleep(CHECK_S + 0.2)  # a refresh answered with all open
    directory, reachable = plane.auth.directory, plane.auth.directory.scheduler
    ended_before = watch.ended
    try:
        directory.scheduler = _silent_scheduler(plane)
        t0 = time.monotonic()
        new_key = plane.run(call(plane.scheduler.rotate_tenant_key, "ann"))  # at another gateway
        time.sleep(STALENESS_MAX_S - 1.5)  # ~3 failed refreshes: nothing ended
        assert not anns.done() and not bobs.done() and not bobs_sse.done()
        code, tokens = anns.result(10)
        took = time.monotonic() - t0
        status, body = bobs.result(10)
        sse_status, sse_body = bobs_sse.result(10)
    finally:
        directory.scheduler = reachable
    assert code == grpc.StatusCode.UNAVAILABLE and tokens > 0, (code, tokens)
    assert ("retry-after-ms", "1000") in anns.call.trailing_metadata()  # type: ignore[attr-defined]
    assert STALENESS_MAX_S - 1.5 < took < STALENESS_MAX_S + CHECK_S + 2.0, took
    error = json.loads(body)["error"]
    assert status == 503 and error["type"] == "service_unavailable", (status, body[:300])
    assert error["message"] == STALE_MESSAGE.format(max_s=STALENESS_MAX_S)
    assert sse_status == 200 and _sse_error(sse_body)["type"] == "service_unavailable", sse_body[-300:]
    wait_for(lambda: plane.node_streams() == {} and plane.in_flight() == 0, 10)  # aborted, released
    assert watch.unconfirmed == 3 and watch.ended == ended_before

    anns_new = plane.grpc_stream(new_key)  # the directory answers again
    wait_for(lambda: plane.node_streams() == {ann: 1}, 30)
    time.sleep(STALENESS_MAX_S + CHECK_S)
    assert not anns_new.done() and watch.unconfirmed == 3
    anns_new.call.cancel()  # type: ignore[attr-defined]
    assert anns_new.result(30)[0] == grpc.StatusCode.CANCELLED
    wait_for(lambda: plane.node_streams() == {} and plane.in_flight() == 0, 10)


def test_a_new_call_passes_on_a_cached_key_for_the_cache_ttl_alone(plane: Plane) -> None:  # noqa: F811
    """With the scheduler silent to this gateway, a key that passed here lately is still served
    from the key cache (GET /v1/models asks nothing else), until ``_CACHE_TTL_S`` after its check
    at the scheduler: then 503 with ``Retry-After``, not a pass on stale knowledge. (A bound
    before this session too; a guard that the staleness bound holds for new calls.)"""
    _, key = plane.register("cal")
    assert _get_models(plane, key)[0] == 200  # checked at the scheduler, cached
    auth, clock = plane.auth, plane.auth.clock
    reachable = auth.scheduler, auth.directory.scheduler
    try:
        auth.scheduler = auth.directory.scheduler = _silent_scheduler(plane)
        assert _get_models(plane, key)[0] == 200
        auth.clock = lambda: clock() + _CACHE_TTL_S  # the cached check is _CACHE_TTL_S old
        status, headers, body = _get_models(plane, key)
    finally:
        auth.scheduler, auth.directory.scheduler = reachable
        auth.clock = clock
    assert status == 503 and body["error"]["type"] == "service_unavailable", (status, body)
    assert int(headers["retry-after"]) >= 1 and headers.get("x-should-retry") != "false", (headers, body)
    assert _get_models(plane, key)[0] == 200  # the scheduler answers again
