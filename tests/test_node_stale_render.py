"""A chat turn whose off-thread render went stale (a turn of its session ended meanwhile) is
rendered again on the renderer thread, never on the node's step thread.

Regression (review 28a F4): the step thread rendered and tokenized such a turn itself: a tenant
sending a short turn and a 567,000-character turn of one session together had the long one
rendered on the step thread, which stopped every tenant's streams for 0.25-1.9 s. Real model
(SmolLM2) and chat template; no Ray. The first render of the long turn is held until the short
turn has finished, so it is stale for sure."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest

SESSION = "t/s"


@pytest.fixture(scope="module")
def node():
    n = CacheNode("stale", NodeConfig(kv_pool_bytes=64 << 20, host_bytes=0), num_threads=1)
    yield n
    n.shutdown()


def turn(rid: str, text: str, max_tokens: int) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="tenant:t", session_id=SESSION,
                       messages=({"role": "user", "content": text},),
                       sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_stale_render_is_redone_off_the_step_thread(node, monkeypatch) -> None:
    calls: list[tuple[str, str]] = []  # (thread name, request id) of every render
    short_done = threading.Event()
    real = CacheNode._prompt

    def prompt(self, req, history, *templater):  # type: ignore[no-untyped-def]
        thread = threading.current_thread().name
        calls.append((thread, req.request_id))
        if req.request_id == "long" and thread.startswith("kvstrata-render") and not short_done.is_set():
            short_done.wait(60)  # the short turn ends meanwhile: this render is stale
        return real(self, req, history, *templater)

    monkeypatch.setattr(CacheNode, "_prompt", prompt)

    async def collect(req: NodeRequest) -> list[dict]:
        events = [e async for e in node.generate(req)]
        if req.request_id == "short":
            short_done.set()
        return events

    async def scenario() -> tuple[list[dict], list[dict], list[dict]]:
        opened = await collect(turn("open", "Hi.", 2))
        short, long = await asyncio.gather(collect(turn("short", "Ok?", 2)),
                                           collect(turn("long", "Tell me about lighthouses. " * 100, 2)))
        return opened, short, long

    opened, short, long = asyncio.run(scenario())
    assert opened[-1]["type"] == short[-1]["type"] == long[-1]["type"] == "finished", (short[-1], long[-1])
    renders = [thread for thread, rid in calls if rid == "long"]
    assert len(renders) == 2, calls  # the stale one, then again
    assert not any(thread.endswith("-steps") for thread in renders), calls
    # the long turn continues the history the short turn left
    assert long[0]["prompt_tokens"] > short[0]["prompt_tokens"] + 2
    history = node.engine.session_history(SESSION)
    assert history is not None and len(history) == long[0]["prompt_tokens"] + 2
    asyncio.run(node.close_session(SESSION, "t"))


@pytest.mark.parametrize("early", [True, False])
def test_a_turn_whose_render_never_matches_is_rendered_again_a_bounded_number_of_times(node, monkeypatch,
                                                                                       early: bool) -> None:
    """Review 28l F1: an opening turn whose session id another tenant's session holds never
    matched its render (rendered without history, compared with the held session's), and was
    queued to the renderer again ~8,500 times a second, never answered. Now at most
    ``MAX_RERENDERS`` times; then the step thread renders it and the engine refuses it
    PERMISSION_DENIED, as before the requeue.

    Since review s36 E1 the step thread refuses such a turn before it compares a render
    (``LLMEngine.check_session_free`` with the turn's namespace: the session is another
    tenant's): the renderer's one render is all (``early``). Without that check (its
    ``namespace`` left out, as before) the requeue's bound holds as it did."""
    from services.cache_node_requests import MAX_RERENDERS

    if not early:
        check = type(node.engine).check_session_free
        monkeypatch.setattr(type(node.engine), "check_session_free",
                            lambda self, session_id, tenant, namespace=None: check(self, session_id, tenant))
    renders: list[str] = []
    real = CacheNode._prompt

    def prompt(self, req, history, *templater):  # type: ignore[no-untyped-def]
        renders.append(req.request_id)
        return real(self, req, history, *templater)

    monkeypatch.setattr(CacheNode, "_prompt", prompt)

    def opening(rid: str, tenant: str) -> NodeRequest:
        return NodeRequest(request_id=rid, tenant=tenant, cache_namespace=f"tenant:{tenant}", session_id="shared",
                           messages=({"role": "user", "content": "Hello there."},), opens_session=True,
                           sampling=SamplingParams(max_tokens=2, ignore_eos=True))

    async def run(req: NodeRequest) -> list[dict]:
        return [e async for e in node.generate(req)]

    async def scenario() -> list[dict]:
        assert (await run(opening("a1", "a")))[-1]["type"] == "finished"
        return await asyncio.wait_for(run(opening("b1", "b")), 30)

    events = asyncio.run(scenario())
    assert events[-1]["type"] == "error" and events[-1]["code"] == "PERMISSION_DENIED", events[-1]
    # first, again twice, then on the step thread; or refused before any render is compared
    assert renders.count("b1") == (1 if early else 1 + MAX_RERENDERS + 1), renders
    asyncio.run(node.close_session("shared", "a"))
