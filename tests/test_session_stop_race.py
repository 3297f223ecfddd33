"""A session turn that reaches the node between its previous turn's stop string and that turn's
last output never builds on the tokens the stop string cut off.

The cache node ends a turn in the engine as soon as its text completes a stop string
(``LLMEngine.abort_request(reason="stop")``); the turn's ``finished`` event, and with it the cut of
the session's history to the reply the client got (``Streams._cut_session_history``), come with
the next step's outputs. Regression (F7): a next turn started in between (sent before its
client had the first turn's ``finished``: a pipelining client) found the session idle, with the
uncut history, and was served on it; the cut that followed found the session running and was
skipped (logged: "session ... changed before its turn ...'s history could be cut"), so that
turn and every later one attended to tokens no client ever got. Now the session counts as
running that turn until its end is reported (``Session.ending``): the turn is refused ABORTED
(session busy), as it is one step earlier, and the same turn sent again after the ``finished``
event answers as the conversation sent without the session.

The real model on the real CacheNode and data plane (fp32 CPU); a hook holds the step thread in
that window until the next turn is queued there, so the window is hit every run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from services.cache_node import CacheNode
from tests import test_session_stop_cut
from tests.test_cache_node_streams import connect
from tests.test_session_stop_cut import NEXT, USER, chat, run, stops
from tests.test_session_turn_cancel import ended_unseen, queued

node = test_session_stop_cut.node  # its fixture: the real CacheNode (fp32 CPU, SmolLM2)


def hold_in_stop_window(node: CacheNode, monkeypatch: pytest.MonkeyPatch, ended: str, nxt: str) -> threading.Event:
    """Hold the step thread before it starts new requests once ``ended``'s stop string ended it
    in the engine (its last output still to come) until ``nxt`` is queued to start; returns
    the event set when it holds."""
    orig = node._start_incoming
    reached = threading.Event()

    def held() -> None:
        if not reached.is_set() and ended_unseen(ended)(node):
            reached.set()
            deadline = time.monotonic() + 30.0
            while not queued(nxt)(node) and time.monotonic() < deadline:
                time.sleep(0.002)
        orig()

    monkeypatch.setattr(node, "_start_incoming", held)
    return reached


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(ev["text"] for ev in events if ev["type"] == "delta")


@pytest.mark.parametrize("policy", ["", "snapkv-0.5"])
def test_a_turn_sent_before_the_stop_strings_end_is_reported_never_sees_the_cut_tokens(
        node: CacheNode, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """Failed on the old code: the second turn was served in the window (its prompt held the
    stop string's tokens: 'finished', not ABORTED), and the session's history kept them."""
    reply, _ = run(node, chat(f"race-ref-{policy}", [USER], policy=policy))
    stop = stops(reply)["several_tokens"]
    cut = reply[: reply.index(stop)]
    sid = f"race-{policy}"
    first, second = f"{sid}/1", f"{sid}/2"

    async def go() -> tuple[dict[str, list[dict[str, Any]]], list[int] | None, dict[str, list[dict[str, Any]]]]:
        gw = await connect(node)
        reached = hold_in_stop_window(node, monkeypatch, first, second)
        await gw.submit(chat(first, [USER], sid=sid, stop=(stop,), policy=policy))
        assert await asyncio.to_thread(reached.wait, 60.0), "the stop string never ended the first turn"
        await gw.submit(chat(second, [NEXT], sid=sid, policy=policy))
        got = await gw.drain({first, second})
        monkeypatch.undo()
        history = node.engine.session_history(sid)
        await gw.submit(chat(f"{sid}/again", [NEXT], sid=sid, policy=policy))  # sent again, after the end
        return got, history, await gw.drain({f"{sid}/again"})

    got, history, again = asyncio.run(go())
    assert got[first][-1]["type"] == "finished" and got[first][-1]["finish_reason"] == "stop"
    assert text_of(got[first]) == cut
    assert got[second] == [{"type": "error", "code": "ABORTED", "message":
                            f"session {sid!r} already has a turn running: one turn at a time per session; "
                            "send this turn again after that one ends"}], got[second]
    templater = node.templater
    prompt = templater.first_turn([USER])
    assert history is not None and history[: len(prompt)] == prompt
    assert node.tokenizer.decode(history[len(prompt):]) == cut  # the cut reply's tokens, no others
    kept = [USER, {"role": "assistant", "content": cut}]
    whole = templater.first_turn([*kept, NEXT])  # the conversation sent without the session
    finished = again[f"{sid}/again"][-1]
    assert finished["type"] == "finished" and finished["prompt_tokens"] == len(whole), finished
    assert node.engine.session_history(sid)[: len(whole)] == whole
    if not policy:  # (a compressing policy's continued turn compresses otherwise than a fresh prompt)
        stateless, _ = run(node, chat(f"race-alone-{policy}", [*kept, NEXT]))
        assert text_of(again[f"{sid}/again"]) == stateless
    assert node.engine.sessions.sessions[sid].ending is None
    assert not node.engine.check_integrity()


def test_a_turn_sent_after_a_cancel_in_the_stop_window_never_sees_the_cancelled_turn(
        node: CacheNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel that lands in the window undoes the ended turn when its end is reported
    (``rewind_session``); a next turn sent after the cancel and reaching the node before that
    report is refused too, and sent again it continues the history as it was before the
    cancelled turn. Failed on the old code: that turn was served on the history holding the
    cancelled turn (which its client never got), and the undo that followed was skipped."""
    thanks = {"role": "user", "content": "Thanks."}
    ref = "race-cancel-ref"
    reply0, _ = run(node, chat(f"{ref}/0", [USER], sid=ref, max_tokens=3))
    reply, _ = run(node, chat(f"{ref}/1", [NEXT], sid=ref))
    words = reply.split(" ")
    assert len(words) > 2, reply
    sid = "race-cancel"
    run(node, chat(f"{sid}/0", [USER], sid=sid, max_tokens=3))
    history = node.engine.session_history(sid)
    first, second = f"{sid}/1", f"{sid}/2"

    async def go() -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
        gw = await connect(node)
        reached = hold_in_stop_window(node, monkeypatch, first, second)
        await gw.submit(chat(first, [NEXT], sid=sid, stop=(" " + words[1],)))
        assert await asyncio.to_thread(reached.wait, 60.0), "the stop string never ended the turn"
        await gw.abort(first)
        deadline = time.monotonic() + 30.0
        while first in node._streams and time.monotonic() < deadline:  # the cancel claimed its stream
            await asyncio.sleep(0.002)
        await gw.submit(chat(second, [thanks], sid=sid, max_tokens=1))
        got = await gw.drain({second})
        monkeypatch.undo()
        await gw.submit(chat(f"{sid}/again", [thanks], sid=sid, max_tokens=1))
        return got, await gw.drain({f"{sid}/again"})

    got, again = asyncio.run(go())
    assert got[second] == [{"type": "error", "code": "ABORTED", "message":
                            f"session {sid!r} already has a turn running: one turn at a time per session; "
                            "send this turn again after that one ends"}], got[second]
    whole = node.templater.first_turn([USER, {"role": "assistant", "content": reply0}, thanks])
    finished = again[f"{sid}/again"][-1]
    assert finished["type"] == "finished" and finished["prompt_tokens"] == len(whole), finished
    assert node.engine.session_history(sid)[: len(whole)] == whole
    assert history == whole[: len(history)]  # the cancelled turn is in neither history
    assert node.engine.sessions.sessions[sid].ending is None and not node.engine.check_integrity()
