"""A session turn's cancel, wherever it lands, keeps the session's token history (the engine's)
and its kept chat messages (the cache node's ``SessionTexts``) on the same turns.

Regression (hangs review N1): a gateway's abort that landed while the turn's last step computed
popped the stream at once (``Commands.abort``) while the engine finished the turn in that step,
so the engine's history kept the cancelled turn (tokens the client never got) and the node's
kept messages did not; the next turn was rendered from messages that did not match the KV the
session kept (its prompt 74 tokens instead of 54). The real model, node and data plane; a hook
holds the step thread at the chosen position until the abort has reached the node, so each
position is hit every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest
from tests.test_cache_node_streams import connect

N = 4  # tokens of the cancelled turn


@pytest.fixture(scope="module")
def node():
    n = CacheNode("t", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0), num_threads=1)
    yield n
    n.shutdown()


def turn(rid: str, sid: str, text: str, max_tokens: int = N, stop: tuple[str, ...] = (), policy: str = "") -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", session_id=sid, policy=policy,
                       messages=({"role": "user", "content": text},),
                       sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stop))


def hold(node: CacheNode, monkeypatch: pytest.MonkeyPatch, rid: str, where: str,
         when: Callable[[Any], bool], locked: bool = False) -> threading.Event:
    """Hold the step thread before ``where`` ("step": the engine step, "start": starting new
    requests) once ``when(node)`` holds, until ``rid``'s abort reached the node (its stream
    is claimed); returns the event set when it holds. ``locked``: hold the engine's lock
    meanwhile, as the step's forward pass does (an abort waiting on it waits for the step)."""
    orig = getattr(node.engine if where == "step" else node, "step" if where == "step" else "_start_incoming")
    reached = threading.Event()

    def held(*args: Any, **kw: Any) -> Any:
        if reached.is_set() or not when(node):
            return orig(*args, **kw)
        with node.engine._lock if locked else contextlib.nullcontext():
            reached.set()
            deadline = time.monotonic() + 30.0
            while rid in node._streams and time.monotonic() < deadline:
                time.sleep(0.002)
            return orig(*args, **kw)

    monkeypatch.setattr(node.engine if where == "step" else node, "step" if where == "step" else "_start_incoming",
                        held)
    return reached


def outputs(rid: str, n: int) -> Callable[[CacheNode], bool]:
    """Before the step that makes ``rid``'s output token ``n + 1`` (0: its prefill)."""
    def when(node: CacheNode) -> bool:
        seq = node.engine.requests.get(rid)
        return seq is not None and len(seq.output_token_ids) == n
    return when


def queued(rid: str) -> Callable[[CacheNode], bool]:
    return lambda node: any(s.request.request_id == rid for s in node._incoming)


def ended_unseen(rid: str) -> Callable[[CacheNode], bool]:
    """The engine ended ``rid`` (a stop string matched) and its last output is still to come."""
    def when(node: CacheNode) -> bool:
        stream = node._streams.get(rid)
        return stream is not None and stream.started and rid not in node.engine.requests
    return when


async def settle(node: CacheNode, rid: str) -> None:
    deadline = time.monotonic() + 30.0
    while rid in node.engine.requests or rid in node._streams or node.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the cancelled turn never ended"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # its last step's delivery is done


async def session_with_one_turn(node: CacheNode, gw: Any, sid: str) -> tuple[list[int], int]:
    await gw.submit(turn(f"{sid}/a", sid, "Tell me about cats."))
    assert (await gw.drain({f"{sid}/a"}))[f"{sid}/a"][-1]["type"] == "finished"
    return node.engine.session_history(sid), len(node._session_messages.get(sid, ()))


async def next_turn_prompt(gw: Any, sid: str) -> int:
    await gw.submit(turn(f"{sid}/c", sid, "Thanks.", max_tokens=1))
    last = (await gw.drain({f"{sid}/c"}))[f"{sid}/c"][-1]
    assert last["type"] == "finished", last
    return last["prompt_tokens"]


async def cancel_at(node: CacheNode, gw: Any, sid: str, reached: threading.Event | None,
                    stop: tuple[str, ...] = ()) -> list[dict]:
    """Run turn ``sid/b``, abort it as the step thread holds at ``reached`` (None: after its
    end), and return the events its gateway got."""
    rid = f"{sid}/b"
    await gw.submit(turn(rid, sid, "And dogs?", max_tokens=8 if stop else N, stop=stop))
    if reached is None:
        got = (await gw.drain({rid}))[rid]
    else:
        assert await asyncio.to_thread(reached.wait, 30.0), "the step thread never reached the position"
        got = []
    await gw.abort(rid)
    await settle(node, rid)
    return got + [ev for r, ev in await gw.poll(0.2) if r == rid]


@pytest.mark.parametrize("position", ["before_first_step", "prefill", "mid_decode", "last_step"])
def test_a_cancelled_turn_is_in_neither_history(node, monkeypatch, position: str) -> None:
    """Wherever the cancel lands before the turn's ``finished`` event left, neither the
    session's token history nor its kept messages hold the turn, and the next turn is rendered
    as though it never ran. ``last_step`` failed on the parent: history 41 -> 61 tokens, kept
    messages 2 -> 2, the next turn's prompt 74 tokens instead of 54."""
    async def run() -> None:
        gw = await connect(node)
        ref_history, ref_count = await session_with_one_turn(node, gw, f"ref-{position}")
        ref_prompt = await next_turn_prompt(gw, f"ref-{position}")
        sid = f"s-{position}"
        history, count = await session_with_one_turn(node, gw, sid)
        assert (history, count) == (ref_history, ref_count)
        rid = f"{sid}/b"
        where, when = {"before_first_step": ("start", queued(rid)), "prefill": ("step", outputs(rid, 0)),
                       "mid_decode": ("step", outputs(rid, N // 2)),
                       "last_step": ("step", outputs(rid, N - 1))}[position]
        got = await cancel_at(node, gw, sid, hold(node, monkeypatch, rid, where, when))
        monkeypatch.undo()
        assert "finished" not in [ev["type"] for ev in got]
        assert node.engine.session_history(sid) == history  # exactly as before the turn
        assert len(node._session_messages.get(sid, ())) == count
        assert await next_turn_prompt(gw, sid) == ref_prompt
        node.engine.check_integrity()

    asyncio.run(run())


def test_a_turn_cancelled_after_its_end_is_in_both_histories(node) -> None:
    """A cancel that reaches the node after the turn's ``finished`` event left changes nothing:
    the turn is in both histories (the engine's and the kept messages)."""
    async def run() -> None:
        gw = await connect(node)
        history, count = await session_with_one_turn(node, gw, "after")
        got = await cancel_at(node, gw, "after", None)
        assert got[-1]["type"] == "finished" and got[-1]["completion_tokens"] == N
        after = node.engine.session_history("after")
        assert after[: len(history)] == history and len(after) == got[-1]["prompt_tokens"] + N
        assert len(node._session_messages.get("after", ())) == count + 2

    asyncio.run(run())


def test_a_turn_cancelled_between_its_stop_string_and_its_last_output_is_in_neither(node, monkeypatch) -> None:
    """The engine ends a turn at once when its text completes a stop string, and its
    ``finished`` event goes out a step later: a cancel landing in between leaves the turn out
    of both histories (failed on the parent: the engine's history kept it, the kept messages
    did not)."""
    async def run() -> None:
        gw = await connect(node)
        await session_with_one_turn(node, gw, "stop-ref")
        await gw.submit(turn("stop-ref/b", "stop-ref", "And dogs?", max_tokens=8))
        ref = (await gw.drain({"stop-ref/b"}))["stop-ref/b"]
        await session_with_one_turn(node, gw, "stop-plain")
        ref_prompt = await next_turn_prompt(gw, "stop-plain")  # a session without the turn
        text = "".join(ev["text"] for ev in ref if ev["type"] == "delta")
        first = [ev for ev in ref if ev["type"] == "delta" and ev["text"].strip()]
        stop = "".join(ev["text"] for ev in ref[: ref.index(first[2]) + 1] if ev["type"] == "delta")
        assert stop.strip() and len(stop) < len(text)  # the third token with text completes it

        history, count = await session_with_one_turn(node, gw, "stop")
        reached = hold(node, monkeypatch, "stop/b", "step", ended_unseen("stop/b"))
        got = await cancel_at(node, gw, "stop", reached, stop=(stop,))
        monkeypatch.undo()
        assert "finished" not in [ev["type"] for ev in got]
        assert node.engine.session_history("stop") == history
        assert len(node._session_messages.get("stop", ())) == count
        assert await next_turn_prompt(gw, "stop") == ref_prompt
        node.engine.check_integrity()

    asyncio.run(run())


def test_a_first_turn_cancelled_in_its_last_step_opens_no_session(node, monkeypatch) -> None:
    """A first turn cancelled as its last step computes leaves no session, as one cancelled a
    step earlier (failed on the parent: the engine kept a session of that turn with no kept
    messages)."""
    async def run() -> None:
        gw = await connect(node)
        rid = "first/a"
        reached = hold(node, monkeypatch, rid, "step", outputs(rid, N - 1))
        await gw.submit(turn(rid, "first", "Tell me about cats."))
        assert await asyncio.to_thread(reached.wait, 30.0)
        await gw.abort(rid)
        await settle(node, rid)
        monkeypatch.undo()
        assert node.engine.session_history("first") is None and "first" not in node._session_messages
        await gw.submit(turn("first/again", "first", "Tell me about cats."))
        again = (await gw.drain({"first/again"}))["first/again"]
        assert again[-1]["type"] == "finished" and len(node._session_messages["first"]) == 2
        node.engine.check_integrity()

    asyncio.run(run())


def test_a_turn_under_a_compressing_policy_cancelled_in_its_last_step_is_undone(node, monkeypatch) -> None:
    """Under a compressing policy the session keeps a policy state; undoing the turn gives the
    session back the state it had before the turn (hangs review 20 W2: it was dropped, and the
    next turn prefilled and compressed the history again), and the next turn continues from it
    (failed on the parent: the engine's history kept the cancelled turn)."""
    async def run() -> None:
        gw = await connect(node)
        policy = "snapkv-0.5"
        await gw.submit(turn("pol/a", "pol", "Tell me about cats.", policy=policy))
        assert (await gw.drain({"pol/a"}))["pol/a"][-1]["type"] == "finished"
        history, count = node.engine.session_history("pol"), len(node._session_messages["pol"])
        rid = "pol/b"
        reached = hold(node, monkeypatch, rid, "step", outputs(rid, N - 1))
        await gw.submit(turn(rid, "pol", "And dogs?", policy=policy))
        assert await asyncio.to_thread(reached.wait, 30.0)
        await gw.abort(rid)
        await settle(node, rid)
        monkeypatch.undo()
        assert node.engine.session_history("pol") == history and len(node._session_messages["pol"]) == count
        sess = node.engine.sessions.sessions["pol"]
        assert sess.kv is not None and sess.kv.compacted and sess.blocks and sess.active_request is None
        continued = node.engine.sessions.num_policy_continuations
        await gw.submit(turn("pol/c", "pol", "Thanks.", max_tokens=1, policy=policy))
        assert (await gw.drain({"pol/c"}))["pol/c"][-1]["type"] == "finished"
        assert len(node._session_messages["pol"]) == count + 2
        assert node.engine.sessions.num_policy_continuations == continued + 1
        node.engine.check_integrity()

    asyncio.run(run())


def test_an_in_process_stream_closed_in_its_turns_last_step_leaves_the_turn_out(node, monkeypatch) -> None:
    """``generate``'s caller closing its stream as the turn's last step computes: neither
    history keeps the turn (failed on the parent: the engine's did)."""
    async def run() -> None:
        async for _ in node.generate(turn("gen/a", "gen", "Tell me about cats.")):
            pass
        history, count = node.engine.session_history("gen"), len(node._session_messages["gen"])
        rid = "gen/b"
        reached = hold(node, monkeypatch, rid, "step", outputs(rid, N - 1), locked=True)
        stream, seen = node.generate(turn(rid, "gen", "And dogs?")), []

        async def consume() -> None:
            async for event in stream:
                seen.append(event["type"])

        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(reached.wait, 30.0)
        task.cancel()  # the caller goes away: the generator's ``finally`` aborts the turn
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await settle(node, rid)
        assert "finished" not in seen
        monkeypatch.undo()
        assert node.engine.session_history("gen") == history and len(node._session_messages["gen"]) == count

    asyncio.run(run())
