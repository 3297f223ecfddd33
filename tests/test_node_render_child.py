"""A cache node renders and tokenizes chat requests in a child process
(``services.render_process``), not on a thread of its own process.

Regression (review s35 E F3): the renderer was a thread of the node's process, and a render
(jinja, pure Python) holds the GIL: one tenant sending 1000-message chats back to back slowed
every other tenant's decoding ~3-4x (inter-token median 5.3 -> 21.8 ms on the tiny model,
CPU), though the render queue takes tenants in turn. Real ``CacheNode`` (the tiny Llama), no
Ray. Also: a render child killed or hung mid-render fails that request alone (INTERNAL, naming
the renderer), and the next render starts a fresh child; a child's out-of-protocol reply is
refused."""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import signal
import statistics
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from bench.chaos_stack import BLOCK_SIZE, POOL_BLOCKS, block_bytes, tiny_checkpoint
from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest
from services.render_process import RenderFailed, RenderProcess

BIG_CHAT = tuple({"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(1000))
"""~40-240 ms to render (the host's load); ~9,400 tokens, past the tiny model's 2,048: refused
after its render, cheaply."""


@pytest.fixture(scope="module")
def node():
    config = NodeConfig(model_path=str(tiny_checkpoint()), block_size=BLOCK_SIZE,
                        kv_pool_bytes=POOL_BLOCKS * block_bytes(), host_bytes=0, max_num_seqs=4)
    n = CacheNode("render-child", config, num_threads=1)
    yield n
    n.shutdown()


def chat(rid: str, tenant: str, messages: tuple[dict[str, str], ...], max_tokens: int = 2) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant=tenant, cache_namespace=f"tenant:{tenant}", messages=messages,
                       sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def tokens(rid: str, max_tokens: int) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="victim", cache_namespace="tenant:victim",
                       token_ids=tuple(range(100, 120)), sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def events(node: CacheNode, req: NodeRequest) -> list[dict[str, Any]]:
    return [e async for e in node.generate(req)]


async def decode_gaps(node: CacheNode, rid: str, n: int = 120) -> list[float]:
    """The seconds between a token-id request's successive deltas (``n`` tokens)."""
    times = [time.perf_counter() async for e in node.generate(tokens(rid, n)) if e["type"] == "delta"]
    assert len(times) == n
    return [b - a for a, b in itertools.pairwise(times)]


def warm(node: CacheNode) -> None:
    """One chat rendered and served (the render child started)."""
    assert asyncio.run(events(node, chat(f"warm-{time.monotonic()}", "warm", BIG_CHAT[:1])))[-1]["type"] == "finished"


def started_child(node: CacheNode) -> RenderProcess:
    """The node's render child, once it rendered a chat."""
    warm(node)
    child = node._render_child
    assert child is not None and child.process.pid is not None
    return child.process


def test_another_tenants_big_chats_do_not_slow_decoding(node: CacheNode) -> None:
    """While tenant "big" keeps two 1000-message chats rendering back to back, the victim's
    inter-token median stays within 1.6x of its median alone, before or after (on the code
    before: ~3-4x). Medians of 119 gaps; the best of three tries (a shared host's load comes
    and goes)."""
    warm(node)
    renders = 0

    async def big_chats(stop: asyncio.Event, lane: int) -> None:
        nonlocal renders
        i = 0
        while not stop.is_set():
            last = (await events(node, chat(f"big-{lane}-{i}-{time.monotonic()}", "big", BIG_CHAT)))[-1]
            assert last["type"] == "error" and "context" in last["message"], last  # rendered, then refused
            renders += 1
            i += 1

    async def under_load(tag: str) -> tuple[float, int]:
        nonlocal renders
        stop = asyncio.Event()
        load = [asyncio.create_task(big_chats(stop, lane)) for lane in range(2)]
        await asyncio.sleep(0.5)  # the renders under way
        before = renders
        gaps = await decode_gaps(node, f"victim-load-{tag}")
        during = renders - before
        stop.set()
        await asyncio.gather(*load)
        return statistics.median(gaps), during

    results = []
    for attempt in range(3):
        before = statistics.median(asyncio.run(decode_gaps(node, f"victim-alone-{attempt}")))
        loaded, during = asyncio.run(under_load(str(attempt)))
        after = statistics.median(asyncio.run(decode_gaps(node, f"victim-alone-again-{attempt}")))
        alone = max(before, after)  # (the host's load moves the medians alone by up to ~1.8x)
        results.append((loaded / alone, alone, loaded, during))
        print(f"victim inter-token median alone {1e3 * before:.1f} / {1e3 * after:.1f} ms, with big chats rendering "
              f"{1e3 * loaded:.1f} ms (x{loaded / alone:.2f}, {during} renders meanwhile)")
        if loaded / alone < 1.6 and during >= 2:  # the big chats rendered all along
            break
    else:
        pytest.fail("another tenant's chats slowed decoding: " + ", ".join(
            f"x{r:.2f} (alone {1e3 * a:.1f} ms, loaded {1e3 * b:.1f} ms, {d} renders)" for r, a, b, d in results))


def test_a_killed_render_child_fails_its_request_alone_and_the_next_render_works(node: CacheNode) -> None:
    process = started_child(node)
    starts, pid = process.num_starts, process.pid
    assert pid is not None
    expected = node.templater.first_turn([{"role": "user", "content": "Name a colour."}])

    async def scenario() -> tuple[list[dict], list[dict], list[dict]]:
        victim = asyncio.create_task(events(node, tokens("kill-victim", 40)))
        os.kill(pid, signal.SIGSTOP)  # (held mid-render, then killed)
        doomed = asyncio.create_task(events(node, chat("kill-doomed", "a", BIG_CHAT)))
        deadline = time.monotonic() + 30
        while not process.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # its request written
        assert process.busy
        os.kill(pid, signal.SIGKILL)
        first = await doomed
        after = await events(node, chat("kill-after", "b", ({"role": "user", "content": "Name a colour."},)))
        return first, after, await victim

    doomed, after, victim = asyncio.run(scenario())
    assert doomed[-1]["type"] == "error" and doomed[-1]["code"] == "INTERNAL", doomed
    assert "chat renderer process ended" in doomed[-1]["message"] and "signal 9" in doomed[-1]["message"], doomed
    assert after[-1]["type"] == "finished" and after[0]["prompt_tokens"] == len(expected), after
    assert victim[-1]["type"] == "finished" and victim[-1]["completion_tokens"] == 40, victim[-1]
    assert process.num_starts == starts + 1 and process.pid not in (None, pid)
    assert not node.engine.check_integrity()


def test_a_hung_render_child_is_killed_at_its_timeout_and_the_next_render_works(node: CacheNode) -> None:
    process = started_child(node)
    pid, timeout = process.pid, process.render_timeout_s
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    process.render_timeout_s = 1.0
    try:
        hung = asyncio.run(events(node, chat("hung", "a", ({"role": "user", "content": "Hello?"},))))
    finally:
        process.render_timeout_s = timeout
    assert hung[-1]["type"] == "error" and hung[-1]["code"] == "INTERNAL", hung
    assert "did not answer within 1 s" in hung[-1]["message"], hung
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    after = asyncio.run(events(node, chat("after-hung", "a", ({"role": "user", "content": "Hello?"},))))
    assert after[-1]["type"] == "finished", after


LIAR = """
    import os, struct, sys
    from array import array
    import msgpack
    out = os.fdopen(1, "wb")
    def read():
        (size,) = struct.unpack(">I", sys.stdin.buffer.read(4))
        return msgpack.unpackb(sys.stdin.buffer.read(size))
    def send(reply):
        body = msgpack.packb(reply, use_bin_type=True)
        out.write(struct.pack(">I", len(body)) + body); out.flush()
    replies = [["ok", array("i", [5, %(vocab)d]).tobytes(), False], ["ok", array("i", [-1]).tobytes(), False],
               ["ok", array("i", [1] * 200000).tobytes(), False], ["ok", array("i", [7, 7]).tobytes(), True],
               ["error", "SystemExit", "x"], ["ok", b"abc", False], ["ok", 5, False], ["ok", b"", "yes"],
               ["ok", array("i", [5, 6]).tobytes()], ["error", "ValueError"],
               ["ok", array("i", [5, 6]).tobytes(), False]]
    read(); send(["ready", "liar"])
    while True:
        read(); send(replies[int(sys.argv[1])])
"""
LIES = ("outside the vocabulary", "outside the vocabulary", "200000 token ids for", "does not start with its history",
        "an error of an unknown kind", "a malformed reply", "a malformed reply", "a malformed reply",
        "a malformed reply", "a malformed reply")


def test_a_render_childs_out_of_protocol_replies_are_refused(node: CacheNode, tmp_path) -> None:
    """Token ids outside the vocabulary, more ids than the input can render to, a continuation
    not starting with its history, an unknown error kind, malformed replies: each kills the
    child and fails its render (``RenderFailed``); a fresh child serves the next.

    Regression (s38): a reply of two values, ``["ok", ids]`` or ``["error", "ValueError"]``,
    raised ``ValueError`` ("not enough values to unpack": the chat refused as the client's bad
    input) or ``IndexError``, and the child was left running."""
    script = tmp_path / "liar.py"
    script.write_text(textwrap.dedent(LIAR % {"vocab": len(node.tokenizer)}))
    process = RenderProcess(node.tokenizer, start_timeout_s=30)
    msgs = [{"role": "user", "content": "hi"}]
    try:
        for case, what in enumerate(LIES):
            process.argv = (sys.executable, str(script), str(case))
            with pytest.raises(RenderFailed, match=what):
                if "history" in what:
                    process.continue_session(msgs, [1, 2], msgs)
                else:
                    process.first_turn(msgs)
            assert process.pid is None  # killed
        process.argv = (sys.executable, str(script), str(len(LIES)))
        assert process.first_turn(msgs) == [5, 6] and process.continue_session(msgs, [1], msgs) == ([5, 6], False)
        assert process.num_starts == len(LIES) + 1
    finally:
        process.close()


def test_a_passing_failure_to_make_the_render_child_fails_that_chat_alone(node: CacheNode, monkeypatch) -> None:
    """A render child that cannot be made for a passing reason (here: the temporary directory
    gone, ``OSError`` saving the tokenizer) fails that chat alone (INTERNAL, naming it); the
    next chat gets a child again. Regression (review s36 R2 F4, the node's kind): any failure
    to make one sent every later chat of the node's life to its own process (the GIL shared
    with the step thread again), as for a tokenizer that can never be saved."""
    started_child(node)
    old = node._render_child
    old.process.close()
    node._render_child = None
    monkeypatch.setattr("tempfile.tempdir", "/nonexistent/kvstrata-render-test")
    failed = asyncio.run(events(node, chat("unmade", "a", BIG_CHAT[:1])))
    assert failed[-1]["type"] == "error" and failed[-1]["code"] == "INTERNAL", failed
    assert node._render_child is None and node._render_unsaved is None
    monkeypatch.undo()
    after = asyncio.run(events(node, chat("made-again", "a", BIG_CHAT[:1])))
    assert after[-1]["type"] == "finished", after
    assert node._render_child is not None and node._render_child.process.pid is not None


def test_a_closed_render_process_starts_no_child(node: CacheNode) -> None:
    """Regression (s39, found by listing the child processes left after each test file: one
    of tests/test_node_health's nodes, shut down 0.2 s after its start, left its render child
    running ~12 s): the renderer thread's warm start ran after the node's shutdown had closed
    the ``RenderProcess`` (finding no child to kill), so a child started anyway and imported,
    a core's worth of CPU, until it failed on the tokenizer ``close`` had removed. Now a start
    after ``close`` is refused at once and starts no process."""
    process = RenderProcess(node.tokenizer, start_timeout_s=30)
    process.close()
    t0 = time.monotonic()
    with pytest.raises(RenderFailed, match="shutting down"):
        process.start()
    assert process.num_starts == 0 and process.pid is None
    assert time.monotonic() - t0 < 1.0


def test_a_render_child_spawned_as_its_process_closes_is_killed(node: CacheNode, monkeypatch) -> None:
    """The other side of that race: ``close`` runs while ``start`` spawns the child (after the
    check at its beginning, before ``proc`` is set: ``close`` finds no child to kill). The
    start kills the child it spawned and fails at once ("shutting down"); before, it sent the
    child its tokenizer (removed by ``close``) and waited on it for seconds."""
    from services import render_process

    process = RenderProcess(node.tokenizer, start_timeout_s=30)
    spawned = []

    def spawn_then_close(argv: Any, workdir: str, *args: Any, **kwargs: Any) -> Any:
        child = real_start_child(argv, workdir, *args, **kwargs)
        if workdir != process.workdir:  # another RenderProcess's (the node's warm start, when this
            return child  # test runs first in its module: the fixture's node was just made)
        spawned.append(child)
        process.close()  # (as the node's shutdown on its own thread, at this moment)
        return child

    real_start_child = render_process.start_child
    monkeypatch.setattr(render_process, "start_child", spawn_then_close)
    t0 = time.monotonic()
    with pytest.raises(RenderFailed, match="shutting down"):
        process.start()
    took = time.monotonic() - t0
    assert len(spawned) == 1 and spawned[0].poll() is not None and process.pid is None
    assert took < 2.0, took


def test_a_close_during_the_start_leaves_the_pipes_to_the_starting_thread(node: CacheNode) -> None:
    """Regression (s39 review: the node's warm start, ``Streams._warm_render_child``): ``start``
    did not mark the process busy, so a ``close`` (the node's shutdown thread) while the
    renderer thread waited for the child's ``ready`` (seconds, as it imports) reaped the child
    and closed its pipes under that thread, which then polled and read closed descriptors
    (``EBADF``; had the number been reused meanwhile, another file: a socket, a spill file).
    Now ``close`` only kills the child and returns; the starting thread, held here between its
    polls of the child's stdout, finds the pipes open, reads the end, reaps the child, closes
    the pipes and fails "shutting down" (no failed start counted); nothing is left."""
    process = RenderProcess(node.tokenizer, start_timeout_s=30)
    tokenizer_dir = process._tokenizer_dir
    waiting, go = threading.Event(), threading.Event()
    real_wait = process._wait

    def held_wait(fd: int, event: int, deadline: float) -> None:
        if event == select.POLLIN and not go.is_set():  # (the wait for ``ready``, past the ``init`` write)
            waiting.set()
            go.wait(30)
        real_wait(fd, event, deadline)

    process._wait = held_wait  # type: ignore[method-assign]
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            process.start()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    thread = threading.Thread(target=start, name="test-render-start")
    thread.start()
    try:
        assert waiting.wait(30), "the start never waited for its ready"
        proc, workdir = process.proc, process.workdir
        assert proc is not None and workdir is not None
        t0 = time.monotonic()
        process.close()  # (as the node's shutdown, on its own thread)
        took = time.monotonic() - t0
        pipes_open = not proc.stdin.closed and not proc.stdout.closed
        still_its = process.proc is proc
    finally:
        go.set()
        thread.join(30)
    assert not thread.is_alive()
    assert pipes_open and still_its, "close() closed the child's pipes while the starting thread polled them"
    assert took < 1.0, took
    assert len(outcome) == 1 and isinstance(outcome[0], RenderFailed), outcome
    assert "shutting down" in str(outcome[0]), outcome[0]
    assert proc.poll() == -signal.SIGKILL and proc.stdin.closed and proc.stdout.closed
    assert process.proc is None and process.pid is None and process.workdir is None
    assert not os.path.exists(workdir) and not os.path.exists(tokenizer_dir)
    assert process.start_guard.failures == 0
