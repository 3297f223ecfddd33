"""The gateway's servicers on a real gRPC server, in-process and without Ray.

The InferenceService has no data plane behind it (nothing is listening at its node and
scheduler addresses): it answers only what the gateway decides before admission (auth,
validation, policy permission, context limits).

The scheduler is a real ``GlobalSchedulerService`` (its tenant store on disk); ``LocalActor``
gives it the ``handle.method.remote(...)`` call shape the servicers use (an awaitable, as a
Ray actor call is). The server runs on its own event loop in a thread, so synchronous gRPC
clients and the CLI can call it.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvstrata.v1 import admin_pb2_grpc, inference_pb2_grpc, tenant_pb2_grpc
from services.auth import Authenticator
from services.gateway import InferenceServicer
from services.gateway_admin import AdminServicer, TenantServicer
from services.global_scheduler_admission import GlobalSchedulerService


class ClusterKeyValues(dict):
    """Ray's GCS key-value store as a gateway's ``services.gateway_served.ServedRecord`` uses it
    (``put``, ``get``, ``delete``), for the ``RayGateway`` tests that run without Ray: one per test
    (``cluster_key_values``), outliving each gateway "process" of the test as the GCS outlives
    an actor's restarts."""

    def put(self, key: bytes, value: bytes) -> None:
        self[key] = value

    def delete(self, key: bytes) -> None:
        self.pop(key, None)

    def list_keys(self, prefix: bytes) -> list[bytes]:
        return [key for key in self if key.startswith(prefix)]


def cluster_key_values(monkeypatch: Any) -> ClusterKeyValues:
    """The test's ``ClusterKeyValues``, which every ``ServedRecord`` made from now on in the test
    keeps its record in (``monkeypatch``: the test's ``pytest.MonkeyPatch``)."""
    from services import gateway_served

    store = ClusterKeyValues()
    monkeypatch.setattr(gateway_served, "GcsKeyValues", lambda: store)
    return store


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return self.fn(*args, **kwargs)

        async def call() -> Any:
            return self.fn(*args, **kwargs)

        return call()


class LocalActor:
    """``obj`` as a Ray actor handle looks to an async caller: ``h.m.remote(...)`` awaitable."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.obj, name))


NODE_INFO = {"data_address": "tcp://127.0.0.1:9", "max_model_len": 2048, "pool_tokens": 4096,
             "block_size": 16, "model_id": "tiny", "kv_format": "bf16"}
"""What ``CacheNode.describe()`` tells the gateway, for a node that is not there."""


@dataclass
class Gateway:
    address: str
    scheduler: GlobalSchedulerService
    admin_key: str
    auth: Authenticator
    loop: asyncio.AbstractEventLoop


@contextmanager
def serve(state_dir: Path, templater: Any = None,
          credentials: grpc.ServerCredentials | None = None) -> Iterator[Gateway]:
    """A gateway (TenantService + AdminService) on 127.0.0.1:<free port>; ``templater``: the
    InferenceService's ``services.chat.ChatTemplater`` (None: chats go to the node unrendered);
    ``credentials``: serve TLS with these (None: plaintext)."""
    scheduler = GlobalSchedulerService(str(state_dir), {"n0": 1})
    admin_key = scheduler.store.ensure_admin_key()
    assert admin_key is not None
    handle = LocalActor(scheduler)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}

    async def start() -> None:
        server = grpc.aio.server()
        auth = Authenticator(handle)
        tenant_pb2_grpc.add_TenantServiceServicer_to_server(TenantServicer(handle, auth), server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(handle, auth, {}), server)
        inference = box["inference"] = InferenceServicer(handle, auth, {}, {"n0": NODE_INFO}, templater,
                                                         "tcp://127.0.0.1:9")
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(inference, server)
        box["port"] = (server.add_insecure_port("127.0.0.1:0") if credentials is None
                       else server.add_secure_port("127.0.0.1:0", credentials))
        await server.start()
        box["server"], box["auth"] = server, auth
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()),
                              daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield Gateway(f"127.0.0.1:{box['port']}", scheduler, admin_key, box["auth"], loop)
    finally:
        asyncio.run_coroutine_threadsafe(box["server"].stop(0), loop).result(10)
        box["inference"].close()  # its tokenizer threads (as ``Gateway.stop``)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        scheduler.store.close()
