"""The gateway's gRPC connection bounds and the checks made before a call's request message
(secrev19 H4/H5).

H4: a client that completed the HTTP/2 handshake (preface, SETTINGS, SETTINGS ACK) and sent
nothing more held its connection forever, with no cap on connections. H5: a call that sent its
HEADERS alone was held before any key check with no deadline (grpc.aio awaits a unary request's
message before running its handler), and Health/Watch held a stream for any service name. The
bounds are ``ServiceConfig``'s ``grpc_*`` settings (``GrpcLimits``), set here to fractions of a
second; every test runs the real ``gateway_server.create_server`` (real ``Authenticator`` over a
real ``GlobalSchedulerService``, ``BoundedHealthServicer``, ``CallGate``) on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pydantic
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstrata.v1 import admin_pb2, inference_pb2, tenant_pb2, tenant_pb2_grpc
from services import gateway_server
from services.config import ServiceConfig, load_config
from services.global_scheduler_admission import GlobalSchedulerService
from services.grpc_bounds import GrpcLimits
from services.grpc_call_gate import UNVERIFIED_CALLS_PER_ADDRESS, CallGate, peer_network
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO, LocalActor

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
PING = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"\x00" * 8
GENERATE = "/kvstrata.v1.InferenceService/Generate"
QUICK = GrpcLimits(handshake_timeout_s=0.5, max_connection_idle_s=0.6, max_connection_age_s=60.0,
                   max_connection_age_grace_s=60.0, min_ping_interval_s=5.0, max_connections=64,
                   message_timeout_s=0.6, max_unverified_calls=1024, max_health_watchers=1024)


class Served:
    """A gateway on 127.0.0.1 (``create_server``), its scheduler, and a tenant's key."""

    def __init__(self, server: Any, port: int, inference: Any, monitor: Any, key: str, admin_key: str) -> None:
        self.server, self.port, self.inference, self.monitor = server, port, inference, monitor
        self.key, self.admin_key = key, admin_key
        self.address = f"127.0.0.1:{port}"

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, limits: GrpcLimits) -> AsyncIterator[Served]:
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    admin_key = scheduler.store.ensure_admin_key()
    _tenant, key = await scheduler.register_tenant(TenantSpec("t"))
    server, port, health, inference, monitor = await gateway_server.create_server(
        LocalActor(scheduler), {}, {"n0": NODE_INFO}, None, "tcp://127.0.0.1:9", grpc_limits=limits)
    await server.start()
    await gateway_server.set_health(health, True)
    try:
        yield Served(server, port, inference, monitor, key, admin_key or "")
    finally:
        monitor.stop()
        await server.stop(0)
        inference.streams.shutdown()
        scheduler.store.close()


async def handshake(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that completed the HTTP/2 handshake and sends nothing more."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PREFACE)
    await reader.read(4096)  # the server's SETTINGS
    writer.write(SETTINGS_ACK)
    await writer.drain()
    return reader, writer


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """Whether the server closes the connection within ``timeout_s`` (frames before: GOAWAY)."""
    try:
        async with asyncio.timeout(timeout_s):
            while await reader.read(65536):
                pass
        return True
    except (TimeoutError, ConnectionError):
        return False


async def health_check(served: Served) -> int:
    async with served.channel() as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def never(done: asyncio.Event) -> AsyncIterator[bytes]:
    await done.wait()  # the request message never comes (``done``: the call ended)
    return
    yield b""


async def headers_only(channel: grpc.aio.Channel, method: str, key: str = "",
                       timeout_s: float = 5.0) -> tuple[grpc.StatusCode, str, float]:
    """A call that sends its HEADERS (and ``key``) and never its request message: its status,
    details and how long the server took to end it."""
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    start, done = time.monotonic(), asyncio.Event()
    call = channel.stream_stream(method)(never(done), metadata=metadata, timeout=timeout_s)
    code = await call.code()
    took = time.monotonic() - start
    done.set()
    return code, await call.details(), took


def test_the_grpc_bounds_are_service_settings_with_bounds(tmp_path: Path) -> None:
    """Regression (secrev19 H4/H5): the gRPC server had no connection or call bounds a
    deployment could set. Now ``ServiceConfig``'s ``grpc_*`` fields set them (defaults equal
    ``GrpcLimits``'), out-of-range values are refused naming the field, and the options grpc
    core gets carry them (in ms), the connection cap at most a quarter of NOFILE."""
    assert GrpcLimits.of(ServiceConfig()) == GrpcLimits()
    path = tmp_path / "kvstrata.yaml"
    path.write_text("grpc_max_connection_idle_s: 30\ngrpc_max_connections: 100\ngrpc_message_timeout_s: 2\n")
    limits = GrpcLimits.of(load_config(path))
    assert (limits.max_connection_idle_s, limits.max_connections, limits.message_timeout_s) == (30.0, 100, 2.0)
    for field, value in [("grpc_max_connection_idle_s", 0), ("grpc_max_connections", 0),
                         ("grpc_message_timeout_s", -1), ("grpc_max_connection_age_grace_s", 0)]:
        with pytest.raises(pydantic.ValidationError, match=field):
            ServiceConfig.model_validate({field: value})
    with pytest.raises(ValueError, match="max_health_watchers"):
        GrpcLimits(max_health_watchers=0)
    options = dict(GrpcLimits().server_options(256, nofile=65536))
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert options["grpc.max_connection_age_ms"] == 7_200_000
    assert options["grpc.max_connection_age_grace_ms"] == 3_600_000
    assert options["grpc.server_handshake_timeout_ms"] == 10_000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000
    assert options["grpc.max_allowed_incoming_connections"] == 4096
    assert dict(GrpcLimits().server_options(256, nofile=1024))["grpc.max_allowed_incoming_connections"] == 256


def test_the_launcher_passes_the_grpc_limits_to_the_gateway() -> None:
    """The launcher hands ``GrpcLimits.of(config)`` to the gateway actor (as fd78d0a did for
    the http_* bounds), and the gateway to ``create_server``."""
    import inspect

    from services import launcher
    assert "GrpcLimits.of(config)" in inspect.getsource(launcher.start_services)
    assert "grpc_limits" in inspect.signature(gateway_server.RayGateway.__init__).parameters
    assert "self.grpc_limits" in inspect.getsource(gateway_server.Gateway.start)


def test_the_admin_methods_named_for_the_refusal_message_exist() -> None:
    """``ADMIN_METHODS`` (the methods whose keyless calls get the admin refusal's message at
    their headers) names real methods of the gateway's services."""
    services = {f"{s.full_name}": s for pb in (admin_pb2, tenant_pb2) for s in pb.DESCRIPTOR.services_by_name.values()}
    for path in gateway_server.ADMIN_METHODS:
        service, method = path.strip("/").split("/")
        assert method in services[service].methods_by_name, path


def test_idle_handshaken_connections_are_closed_and_a_valid_call_is_served(tmp_path: Path) -> None:
    """Regression (secrev19 H4): 40 connections that completed the handshake and sent nothing
    stayed open forever. Now each is closed after ``max_connection_idle_s`` (0.6 s), and one
    that never finishes its handshake after ``handshake_timeout_s`` (0.5 s), while another
    client's call is served."""

    async def run() -> None:
        async with serve(tmp_path, QUICK) as served:
            idle = [await handshake(served.port) for _ in range(40)]
            silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", served.port)
            assert await health_check(served) == health_pb2.HealthCheckResponse.SERVING
            start = time.monotonic()
            closed = await asyncio.gather(*(closed_within(reader, 5.0) for reader, _ in idle))
            assert all(closed) and time.monotonic() - start < 3.0
            assert await closed_within(silent_reader, 3.0)
            assert await health_check(served) == health_pb2.HealthCheckResponse.SERVING
            for _, writer in [*idle, (silent_reader, silent_writer)]:
                writer.close()

    asyncio.run(run())


def test_connections_past_the_cap_are_closed_at_accept(tmp_path: Path) -> None:
    """Regression (secrev19 H4): nothing capped connections (an unauthenticated client reached
    NOFILE, and another client's call got DEADLINE_EXCEEDED). Now ``max_connections`` (4) are
    held and the next is closed at once; once they go, a client is served again."""

    async def run() -> None:
        limits = GrpcLimits(**{**QUICK.__dict__, "max_connections": 4, "max_connection_idle_s": 60.0})
        async with serve(tmp_path, limits) as served:
            held = [await handshake(served.port) for _ in range(4)]
            await asyncio.sleep(0.2)
            assert not any(await asyncio.gather(*(closed_within(r, 0.3) for r, _ in held)))
            reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
            writer.write(PREFACE)
            assert await closed_within(reader, 2.0)
            for _, w in held:
                w.close()
            await asyncio.sleep(0.3)
            assert await health_check(served) == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(run())


def test_a_client_pinging_faster_than_allowed_is_closed(tmp_path: Path) -> None:
    """Keepalive enforcement: pings without data more often than ``min_ping_interval_s`` (5 s
    here) close the connection after ``MAX_PING_STRIKES`` (was: grpc core's 5 min default, not
    a setting); one ping is answered and the connection kept."""

    async def run() -> None:
        limits = GrpcLimits(**{**QUICK.__dict__, "max_connection_idle_s": 60.0})
        async with serve(tmp_path, limits) as served:
            calm_reader, calm_writer = await handshake(served.port)
            calm_writer.write(PING)
            assert not await closed_within(calm_reader, 0.5)
            reader, writer = await handshake(served.port)
            for _ in range(5):
                writer.write(PING)
                await writer.drain()
                await asyncio.sleep(0.05)
            assert await closed_within(reader, 2.0)
            calm_writer.close()
            writer.close()

    asyncio.run(run())


def test_a_streaming_call_past_the_connection_age_gets_its_grace(tmp_path: Path) -> None:
    """``max_connection_age_s`` (0.5 s) sends GOAWAY, but a server-streaming call open then
    (Health/Watch here, as a long Generate would be) keeps running and receiving through the
    grace (1.5 s), and is cut only after it; the client's channel makes its next call on a new
    connection without an error."""

    async def run() -> None:
        limits = GrpcLimits(**{**QUICK.__dict__, "max_connection_age_s": 0.5, "max_connection_age_grace_s": 1.5,
                               "max_connection_idle_s": 60.0})
        async with serve(tmp_path, limits) as served, served.channel() as channel:
            health = health_pb2_grpc.HealthStub(channel)
            start = time.monotonic()
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(1.2)  # past the age (0.5 s, grpc jitters it 10%), within the grace
            assert watch.done() is False
            serving = health_pb2.HealthCheckResponse.SERVING
            assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == serving
            assert (await watch.code(), await watch.details()) == (grpc.StatusCode.UNAVAILABLE, "max connection age")
            assert 1.7 < time.monotonic() - start < 3.5  # age + grace

    asyncio.run(run())


def test_calls_without_a_valid_key_are_refused_at_their_headers(tmp_path: Path) -> None:
    """Regression (secrev19 H5): a Generate that sent HEADERS alone, with no key, was held with
    no deadline before any key check. Now a missing, malformed or nonexistent key is refused
    UNAUTHENTICATED right after the headers (well before ``message_timeout_s``, 5 s here), with
    the message its handler would give (an admin method's for an admin method); 250 such calls
    at once on one connection are all refused at once."""

    async def run() -> None:
        limits = GrpcLimits(**{**QUICK.__dict__, "message_timeout_s": 5.0})
        async with serve(tmp_path, limits) as served, served.channel() as channel:
            for key in ("", "not-a-key", "kvs_0123456789ab_" + "x" * 43, "kvs_0123456789abcdef_" + "x" * 43):
                code, details, took = await headers_only(channel, GENERATE, key)
                assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key"), key
                assert took < 2.0
            code, details, _ = await headers_only(channel, "/kvstrata.v1.AdminService/Stats")
            assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "this call needs the admin key")
            results = await asyncio.gather(*(headers_only(channel, GENERATE) for _ in range(250)))
            assert {code for code, _, _ in results} == {grpc.StatusCode.UNAUTHENTICATED}
            assert max(took for _, _, took in results) < 3.0
            assert await health_check(served) == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(run())


def test_a_call_whose_message_never_comes_ends_at_the_message_timeout(tmp_path: Path) -> None:
    """Regression (secrev19 H5): a call with a valid key (and one with an existing key id but
    another secret) that never sent its request message was held forever. Now it ends
    DEADLINE_EXCEEDED at ``message_timeout_s`` (0.6 s); a valid call is served as before
    (its message reaches ``Generate``, which answers it: INVALID_ARGUMENT for an empty
    prompt), and a valid admin call too."""

    async def run() -> None:
        async with serve(tmp_path, QUICK) as served, served.channel() as channel:
            with pytest.raises(grpc.aio.AioRpcError) as empty:
                stream = channel.unary_stream(GENERATE, inference_pb2.GenerateRequest.SerializeToString,
                                              inference_pb2.GenerateResponse.FromString)
                async for _ in stream(inference_pb2.GenerateRequest(), metadata=(("authorization", f"Bearer {served.key}"),),
                                      timeout=5):
                    pass
            assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            code, details, took = await headers_only(channel, GENERATE, served.key)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "no request message within 0.6 s" in details
            assert 0.5 < took < 2.0
            wrong = served.key[:17] + "A" * 43  # kvs_<its id>_<another secret>
            code, _, took = await headers_only(channel, GENERATE, wrong)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 2.0
            listed = await tenant_pb2_grpc.TenantServiceStub(channel).ListTenants(
                tenant_pb2.ListTenantsRequest(), metadata=(("authorization", f"Bearer {served.admin_key}"),), timeout=5)
            assert [t.spec.name for t in listed.tenants] == ["t"]

    asyncio.run(run())


def test_calls_waiting_for_their_message_with_unverified_keys_are_capped(tmp_path: Path) -> None:
    """Calls whose key was not verified here lately may wait for their message at most
    ``UNVERIFIED_CALLS_PER_ADDRESS`` from one client network (and ``max_unverified_calls`` in
    all: 3 here); one past it ends the oldest waiting one RESOURCE_EXHAUSTED at once and waits
    in its place."""

    async def run() -> None:
        limits = GrpcLimits(**{**QUICK.__dict__, "max_unverified_calls": 3, "message_timeout_s": 1.5})
        async with serve(tmp_path, limits) as served, served.channel() as channel:
            wrong = served.key[:17] + "A" * 43  # kvs_<its id>_<another secret>
            waiting = [asyncio.ensure_future(headers_only(channel, GENERATE, wrong)) for _ in range(3)]
            await asyncio.sleep(0.4)
            code, details, _ = await headers_only(channel, GENERATE, wrong)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details  # waited in the oldest's place
            ended = [(c, took < 1.0) for c, _, took in await asyncio.gather(*waiting)]
            assert sorted(ended, key=str) == sorted([(grpc.StatusCode.RESOURCE_EXHAUSTED, True)]
                                                    + [(grpc.StatusCode.DEADLINE_EXCEEDED, False)] * 2, key=str)

    asyncio.run(run())
    assert UNVERIFIED_CALLS_PER_ADDRESS == 64
    assert peer_network("ipv6:[2001:db8:1:2:3:4:5:6]:5000") == peer_network("ipv6:[2001:db8:1:2::9]:1") \
        == "ipv6:2001:db8:1:2::/64"
    assert peer_network("ipv4:10.0.0.1:53412") == "ipv4:10.0.0.1"


def test_a_full_waiting_room_sheds_the_most_waiting_networks_oldest_call() -> None:
    """Regression (review of ddf59ab, R1): the unverified calls' places were first come, first
    served, so calls that never sent their message kept every other unverified call of their
    network (or, from 16 networks, of all) out. Now a new call sheds the oldest waiting one:
    of its own network when that is at its cap, else of the network waiting with the most."""
    async def run() -> None:
        gate = CallGate(None, GrpcLimits(**{**QUICK.__dict__, "max_unverified_calls": 4}), frozenset())  # type: ignore[arg-type]
        gate.unverified.per_network = 3
        a = [gate._wait_slot("ipv4:10.0.0.1") for _ in range(3)]
        b = gate._wait_slot("ipv4:10.0.0.2")
        assert all(f is not None and not f.done() for f in (*a, b))
        assert gate._wait_slot("ipv4:10.0.0.3") is not None  # all 4 taken: sheds .1's oldest
        assert a[0].done() and not a[1].done() and not b.done() and gate.shed == 1
        assert gate._wait_slot("ipv4:10.0.0.3") is not None  # .1 (2) still waits with the most
        assert a[1].done() and not b.done()
        c = [f for f, net in gate.waiting.items() if net == "ipv4:10.0.0.3"]
        assert gate._wait_slot("ipv4:10.0.0.3") is not None  # now .3 waits with the most (2)
        assert c[0].done() and not c[1].done() and gate.unverified.open == {
            "ipv4:10.0.0.1": 1, "ipv4:10.0.0.2": 1, "ipv4:10.0.0.3": 2}
        roomy = CallGate(None, GrpcLimits(**{**QUICK.__dict__, "max_unverified_calls": 100}), frozenset())  # type: ignore[arg-type]
        roomy.unverified.per_network = 2
        d = [roomy._wait_slot("ipv4:10.0.0.5") for _ in range(3)]  # the 3rd: its network at its cap
        assert d[0].done() and not d[1].done() and roomy.unverified.open == {"ipv4:10.0.0.5": 2}

    asyncio.run(run())


def test_peer_network_reads_the_peer_strings_grpc_writes() -> None:
    """Regression (review of ddf59ab, R4): grpc writes IPv6 peers percent-encoded
    (``ipv6:%5B::1%5D:47808``, checked on a dual-stack listener with grpcio 1.85), which
    ``peer_network`` returned whole, port included: every IPv6 connection was a network of its
    own. An IPv4-mapped IPv6 peer counts as its IPv4 address."""
    assert peer_network("ipv6:%5B::1%5D:47808") == peer_network("ipv6:%5B::1%5D:52498") == "ipv6:::/64"
    assert peer_network("ipv6:%5B2001:db8:1:2::7%5D:5000") == "ipv6:2001:db8:1:2::/64"
    assert peer_network("ipv6:[::ffff:1.2.3.4]:5000") == peer_network("ipv4:1.2.3.4:6000") == "ipv4:1.2.3.4"
    assert peer_network("unix:/tmp/s") == "unix:/tmp/s"


def test_health_watch_answers_only_known_names_and_is_bounded(tmp_path: Path) -> None:
    """Regression (secrev19 H5): Watch held a stream open for any client-chosen service name,
    unbounded. Now an unknown name ends NOT_FOUND at once, the gateway's names are watched
    (SERVING), and past ``max_health_watchers`` (2) a Watch ends RESOURCE_EXHAUSTED with a
    retry hint (oairev20 O2: it had none)."""

    async def run() -> None:
        limits = GrpcLimits(**{**QUICK.__dict__, "max_health_watchers": 2, "max_connection_idle_s": 60.0})
        async with serve(tmp_path, limits) as served, served.channel() as channel:
            health = health_pb2_grpc.HealthStub(channel)
            unknown = health.Watch(health_pb2.HealthCheckRequest(service="x0-1"), timeout=5)
            assert await unknown.code() == grpc.StatusCode.NOT_FOUND
            watches = [health.Watch(health_pb2.HealthCheckRequest(service=name))
                       for name in ("", "kvstrata.v1.InferenceService")]
            assert [(await w.read()).status for w in watches] == [health_pb2.HealthCheckResponse.SERVING] * 2
            third = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert await third.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(await third.trailing_metadata())["retry-after-ms"] == "1000"  # oairev20 O2
            for w in watches:
                w.cancel()
            await asyncio.sleep(0.2)
            again = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
            again.cancel()

    asyncio.run(run())


class _Passing:
    """An authenticator every key passes (``CallGate``'s two questions)."""

    async def refuse_unknown_key(self, context: Any, role: str) -> None:
        return None

    def is_verified(self, context: Any) -> bool:
        return True


@contextlib.asynccontextmanager
async def _gated(limits: GrpcLimits, handlers: dict[str, Any]) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a server of service ``t.T`` with ``handlers`` behind a ``CallGate`` whose
    authenticator passes every key."""
    server = grpc.aio.server(interceptors=[CallGate(_Passing(), limits, frozenset())])  # type: ignore[arg-type]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(0)


def test_a_streaming_call_runs_past_the_message_timeout() -> None:
    """``message_timeout_s`` (0.3 s) bounds only the wait for the request message: a
    server-streaming call, written by an async generator or with ``context.write``, streams
    for longer (4 replies 0.2 s apart) and ends OK, its reply to its own request."""

    async def as_generator(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(4):
            await asyncio.sleep(0.2)
            yield request + bytes([i])

    async def with_write(request: bytes, context: Any) -> None:
        async for reply in as_generator(request, context):
            await context.write(reply)

    async def run() -> None:
        limits = GrpcLimits(**{**QUICK.__dict__, "message_timeout_s": 0.3})
        async with _gated(limits, {"Gen": grpc.unary_stream_rpc_method_handler(as_generator),
                                   "Write": grpc.unary_stream_rpc_method_handler(with_write)}) as channel:
            for method in ("/t.T/Gen", "/t.T/Write"):
                start = time.monotonic()
                call = channel.unary_stream(method)(b"r", timeout=5)
                assert [reply async for reply in call] == [b"r\x00", b"r\x01", b"r\x02", b"r\x03"]
                assert await call.code() == grpc.StatusCode.OK and time.monotonic() - start > 0.7

    asyncio.run(run())


def test_a_call_failed_by_a_restarting_actor_carries_the_retry_hint() -> None:
    """Regression (bench.chaos ``kill_scheduler``): while Ray restarted the killed scheduler, a
    call whose key check reached it (a key not checked in the last 10 s) failed with Ray's
    ``ActorUnavailableError`` and ended UNAVAILABLE with no ``retry-after-ms``, unlike the
    admissions refused meanwhile (1000), though a retry a second later succeeds. Unary and both
    kinds of server-streaming calls now carry the hint; a dead-for-good actor's do not (above)."""
    import ray.exceptions

    from services.ray_errors import PROCESS_UNREACHABLE

    def restarting() -> Exception:
        return ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable", None)

    async def unary(request: bytes, context: Any) -> bytes:
        raise restarting()

    async def as_generator(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"first"
        raise restarting()

    async def with_write(request: bytes, context: Any) -> None:
        await context.write(b"first")
        raise restarting()

    async def run() -> None:
        async with _gated(QUICK, {"Unary": grpc.unary_unary_rpc_method_handler(unary),
                                  "Gen": grpc.unary_stream_rpc_method_handler(as_generator),
                                  "Write": grpc.unary_stream_rpc_method_handler(with_write)}) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary("/t.T/Unary")(b"r", timeout=5)
            assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                                       PROCESS_UNREACHABLE)
            assert dict(refused.value.trailing_metadata())["retry-after-ms"] == "1000"
            for method in ("/t.T/Gen", "/t.T/Write"):
                call = channel.unary_stream(method)(b"r", timeout=5)
                assert await call.read() == b"first"
                assert await call.code() == grpc.StatusCode.UNAVAILABLE
                assert dict(await call.trailing_metadata())["retry-after-ms"] == "1000"

    asyncio.run(run())


def test_a_call_failed_by_a_dead_actor_ends_unavailable_with_a_plain_message() -> None:
    """Regression (review 23b, F2): a servicer whose scheduler call failed with Ray's
    ``ActorDiedError`` (the scheduler's process died) ended the call UNKNOWN with Ray's
    exception text; unary and both kinds of server-streaming calls now end UNAVAILABLE with
    ``PROCESS_UNREACHABLE``. An unrelated error ended UNKNOWN with its class and text; now
    INTERNAL with an incident id (``CallGate``'s point 5)."""
    import ray.exceptions

    from services.ray_errors import PROCESS_UNREACHABLE

    async def unary(request: bytes, context: Any) -> bytes:
        if request == b"bug":
            raise ValueError("a bug")
        raise ray.exceptions.ActorDiedError()

    async def as_generator(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"first"
        raise ray.exceptions.ActorDiedError()

    async def with_write(request: bytes, context: Any) -> None:
        await context.write(b"first")
        raise ray.exceptions.ActorDiedError()

    async def run() -> None:
        async with _gated(QUICK, {"Unary": grpc.unary_unary_rpc_method_handler(unary),
                                  "Gen": grpc.unary_stream_rpc_method_handler(as_generator),
                                  "Write": grpc.unary_stream_rpc_method_handler(with_write)}) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as died:
                await channel.unary_unary("/t.T/Unary")(b"r", timeout=5)
            assert (died.value.code(), died.value.details()) == (grpc.StatusCode.UNAVAILABLE, PROCESS_UNREACHABLE)
            assert "retry-after-ms" not in dict(died.value.trailing_metadata() or ())  # dead for good
            with pytest.raises(grpc.aio.AioRpcError) as bug:
                await channel.unary_unary("/t.T/Unary")(b"bug", timeout=5)
            # an unrelated error: INTERNAL with an incident id, its text and class kept in the log
            assert bug.value.code() == grpc.StatusCode.INTERNAL, bug.value
            assert "a bug" not in bug.value.details() and "ValueError" not in bug.value.details()
            assert bug.value.details().startswith("internal error (incident ")
            for method in ("/t.T/Gen", "/t.T/Write"):
                call = channel.unary_stream(method)(b"r", timeout=5)
                assert await call.read() == b"first"
                assert await call.code() == grpc.StatusCode.UNAVAILABLE
                assert await call.details() == PROCESS_UNREACHABLE

    asyncio.run(run())
