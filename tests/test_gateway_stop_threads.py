"""A stopped gateway leaves none of its tokenizer threads (``kvstrata-tokenize``) behind.

Regression (s39): ``Gateway.stop`` stopped the servers, the monitor and the data plane but not
the ``InferenceServicer``'s tokenizer thread pool, so every stop, and every start a restarted
gateway retried after a failed one, left up to ``TOKENIZER_THREADS`` threads waiting forever.
The real ``Gateway`` (gRPC, the OpenAI-compatible HTTP API, ``NodeStreams``, ``NodeMonitor``)
on 127.0.0.1 without Ray, as in ``test_gateway_restart_start``: a real ``GlobalSchedulerService``
behind ``LocalActor`` and a fake cache node that answers ``describe`` and ``health``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from bench.chaos_stack import tiny_checkpoint
from services import gateway_server
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor, cluster_key_values
from tests.test_gateway_restart_start import free_port, nodes, scheduler

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def gcs(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster_key_values(monkeypatch)


def tokenizer_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """``kvstrata-tokenize`` threads alive now that were not in ``before``."""
    return [t for t in threading.enumerate() if t.name.startswith("kvstrata-tokenize") and t not in before]


async def tokenize(port: int, key: str, prompt: str) -> list[int]:
    """``POST /tokenize``: the ids of ``prompt``, tokenized on the gateway's tokenizer threads."""
    def post() -> list[int]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", json.dumps({"prompt": prompt}).encode(),
                                         {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())["tokens"]
    return await asyncio.to_thread(post)


async def gone_within(before: set[threading.Thread], timeout_s: float) -> list[threading.Thread]:
    """The new tokenizer threads still alive after up to ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while tokenizer_threads(before) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return tokenizer_threads(before)


def test_stop_ends_the_tokenizer_threads_of_every_start(tmp_path: Path) -> None:
    """Two starts of one gateway (a restart's retry), each tokenizing prompts on its threads:
    within 2 s of each ``stop`` none of that start's ``kvstrata-tokenize`` threads is alive, and
    the second start tokenizes as the first did (its own pool)."""
    before = set(threading.enumerate())

    async def go() -> None:
        async with scheduler(tmp_path) as sched:
            _tenant, key = await sched.register_tenant(TenantSpec("ann"))
            http_port = free_port()
            gw = gateway_server.Gateway(LocalActor(sched), nodes(), str(tiny_checkpoint()), http_port=http_port)
            answers = []
            for _ in range(2):
                await gw.start("127.0.0.1", free_port())
                try:
                    answers.append(await asyncio.gather(*(tokenize(http_port, key, f"hello {i}") for i in range(3))))
                    assert tokenizer_threads(before), "the prompts were not tokenized on the tokenizer threads"
                finally:
                    await gw.stop(0)
                assert await gone_within(before, 2.0) == []
            assert answers[0] == answers[1] and all(answers[0])

    asyncio.run(go())
