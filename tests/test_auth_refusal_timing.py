"""When a refused API key is answered late, and when never (new-user report: "some 401s arrive
after ~5 s with a short body; malformed keys do not count toward the failed-key limit").

No 401 is delayed by the server. The late ones are the OpenAI client's: past
``failures_per_peer_key`` wrong secrets for one key id from one address in
``failure_window_s`` (10 in 10 s by default) the gateway answers 429 with ``Retry-After`` (the
time until the address's oldest failure leaves the window, 0-10 s), the client sleeps that
long and retries (``max_retries`` 2), and its retry, checked again, is the 401 the caller sees:
brute-force damping, as documented in README.md ('Keys'). A missing key, a malformed one and
one whose id exists nowhere cost no check and never count, so they are answered 401 at once
whatever the address's failures. Real ``HttpServer``, ``OpenAIEdge``, ``Authenticator`` and
``GlobalSchedulerService``; the window is shortened to 1 s.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import openai

from services.auth import Authenticator
from services.global_scheduler_admission import GlobalSchedulerService
from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.server import HttpServer
from tenants.keys import new_api_key
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor

WINDOW_S = 1.0


def test_only_wrong_secrets_past_the_limit_wait_and_keyless_or_malformed_keys_never_do(tmp_path: Path) -> None:
    """Two wrong secrets of an existing key id are 401 at once; the third is 429 with
    ``Retry-After``, which the OpenAI client sleeps out (~1 s here) before its retry ends 401;
    meanwhile a request with no key, a malformed key or a key of an id that exists nowhere, from
    the same address, is 401 at once, and so is the tenant's valid key answered 200."""

    async def run() -> None:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        _tenant, key = await scheduler.register_tenant(TenantSpec("t"))
        auth = Authenticator(LocalActor(scheduler), failures_per_peer_key=2, failure_window_s=WINDOW_S)
        server = HttpServer(create_app(OpenAIEdge(types.SimpleNamespace(auth=auth), "m@0:f16", list,  # type: ignore[arg-type]
                                                  lambda: 1)))
        port = await server.start("127.0.0.1", 0)
        key_id = key.split("_")[1]

        async def list_models(api_key: str, headers: dict[str, str] | None = None) -> tuple[int, float]:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key,
                                        default_headers=headers)
            start = time.monotonic()
            try:
                await client.models.list()
                status = 200
            except openai.APIStatusError as err:
                status = err.status_code
            await client.close()
            return status, time.monotonic() - start

        def wrong_secret() -> str:
            return f"kvs_{key_id}_" + secrets.token_urlsafe(32)[:43]

        try:
            for _ in range(2):
                status, took_s = await list_models(wrong_secret())
                assert status == 401 and took_s < 0.5
            status, took_s = await list_models(wrong_secret())  # 429, slept out, retried: 401
            assert status == 401 and 0.5 < took_s < 2 * WINDOW_S + 1.0
            for _ in range(2):  # over the limit again, at once
                await list_models(wrong_secret())
            for api_key, headers in [("x", {"Authorization": ""}), ("sk-not-a-kvstrata-key", None),
                                     (new_api_key(), None), (key, None)]:
                status, took_s = await list_models(api_key, headers)
                assert (status, took_s < 0.5) == (200 if api_key == key else 401, True), api_key
        finally:
            await server.stop()
            scheduler.store.close()

    asyncio.run(run())


def test_the_limit_counts_ten_different_wrong_keys_not_attempts(tmp_path: Path) -> None:
    """README.md ('Keys') and docs/architecture.md ('Rate limits'), at the gateway's defaults:
    the failed-key limit counts different wrong keys of one key id from one address (10 in
    10 s), not attempts. One wrong key sent 15 times is 401 each time (answered from the
    gateway's cache of failed keys, counted once); 9 more different ones are 401 too; the 11th
    different one is 429 with ``Retry-After``, and the tenant's valid key is still 200."""

    async def run() -> None:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        _tenant, key = await scheduler.register_tenant(TenantSpec("t"))
        auth = Authenticator(LocalActor(scheduler))  # the gateway's (``gateway_server.create_server``)
        assert auth.failures_per_peer_key == 10
        server = HttpServer(create_app(OpenAIEdge(types.SimpleNamespace(auth=auth), "m@0:f16", list,  # type: ignore[arg-type]
                                                  lambda: 1)))
        port = await server.start("127.0.0.1", 0)
        key_id = key.split("_")[1]

        async def status_of(api_key: str) -> tuple[int, str | None]:
            def get() -> tuple[int, str | None]:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                                 headers={"Authorization": f"Bearer {api_key}"})
                try:
                    with urllib.request.urlopen(request, timeout=10) as reply:
                        return reply.status, None
                except urllib.error.HTTPError as err:
                    return err.code, err.headers.get("Retry-After")
            return await asyncio.to_thread(get)

        def wrong_secret() -> str:
            return f"kvs_{key_id}_" + secrets.token_urlsafe(32)[:43]

        try:
            same = wrong_secret()
            assert [(await status_of(same))[0] for _ in range(15)] == [401] * 15
            assert [(await status_of(wrong_secret()))[0] for _ in range(9)] == [401] * 9
            status, retry_after = await status_of(wrong_secret())
            assert status == 429 and retry_after is not None and 1 <= int(retry_after) <= 10
            assert (await status_of(key))[0] == 200
        finally:
            await server.stop()
            scheduler.store.close()

    asyncio.run(run())
