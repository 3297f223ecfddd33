"""One tenant's chat that blows the node's shared chat renderer child's memory cap fails alone and
precisely, and another tenant's chat sent at the same time is served with its right output (s39
open item 3). Real ``CacheNode`` (the tiny Llama with SmolLM2's tokenizer), real render children,
no Ray; the child's cap lowered to 140 MiB (ready, it holds ~124 MiB) so that a chat the tiny
model's context admits (100K characters of emoji and accents, ~200K tokens to tokenize) passes it.

A chat whose tokenizing passes the cap aborts the child (the tokenizer's Rust: "memory
allocation of N bytes failed", SIGABRT). Regression: its tenant got INTERNAL "the chat renderer
process ended ... send this one again" (the server's fault, which a client retries, each retry a
fresh child's start on the renderer every tenant shares); now INVALID_ARGUMENT naming its
messages and the cap, as a ``MemoryError`` in the child's Python already was. The other tenant's
chat, sent while the bomb renders, waits for it and is served on a fresh child: the same tokens
as alone (greedy). Likewise a render that hangs (its child stopped) fails at the render
timeout alone, and a chat sent meanwhile is served on a fresh child.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from bench.chaos_stack import BLOCK_SIZE, POOL_BLOCKS, block_bytes, tiny_checkpoint
from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest
from services.render_process import RenderProcess, _died_of_memory

CAP_MIB = 140
BOMB = ({"role": "user", "content": "\U0001F600\u00e9" * 50_000},)
"""100,000 characters (under the tiny model's 2,048 x 81 a chat may hold): past a 140 MiB cap."""
QUESTION = ({"role": "user", "content": "Name a colour."},)


@pytest.fixture(scope="module")
def node():
    config = NodeConfig(model_path=str(tiny_checkpoint()), block_size=BLOCK_SIZE,
                        kv_pool_bytes=POOL_BLOCKS * block_bytes(), host_bytes=0, max_num_seqs=4)
    n = CacheNode("render-tenants", config, num_threads=1)
    yield n
    n.shutdown()


def chat(rid: str, tenant: str, messages: tuple[dict[str, str], ...]) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant=tenant, cache_namespace=f"tenant:{tenant}", messages=messages,
                       sampling=SamplingParams(max_tokens=8, ignore_eos=True))


async def events(node: CacheNode, req: NodeRequest) -> list[dict[str, Any]]:
    return [e async for e in node.generate(req)]


def output(evs: list[dict[str, Any]]) -> list[int]:
    assert evs[-1]["type"] == "finished", evs[-1]
    return [t for e in evs if e["type"] == "delta" for t in e["token_ids"]]


def capped_child(node: CacheNode) -> tuple[RenderProcess, list[int]]:
    """The node's render child under ``CAP_MIB``, started and warm (it rendered one chat), and
    the output of tenant "good"'s ``QUESTION`` alone (greedy: what it must be with any load)."""
    first = asyncio.run(events(node, chat(f"warm-{time.monotonic()}", "good", QUESTION)))
    process = node._render_child.process
    process.memory_bytes = CAP_MIB << 20
    process.kill()  # (no render under way: the next starts a child under the cap)
    alone = output(asyncio.run(events(node, chat(f"alone-{time.monotonic()}", "good", QUESTION))))
    assert alone == output(first) and len(alone) == 8
    assert process.pid is not None
    return process, alone


def test_a_chat_past_the_render_childs_memory_cap_fails_alone_as_its_size(node: CacheNode) -> None:
    process, alone = capped_child(node)

    async def together() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        bomb = asyncio.create_task(events(node, chat("bomb", "evil", BOMB)))
        await asyncio.sleep(0.05)  # (its render first: the good chat waits behind it)
        good = asyncio.create_task(events(node, chat("good-with-bomb", "good", QUESTION)))
        return await bomb, await good

    starts = process.num_starts
    bomb, good = asyncio.run(together())
    assert bomb[-1]["type"] == "error", bomb[-1]
    assert bomb[-1]["code"] == "INVALID_ARGUMENT", bomb[-1]
    assert bomb[-1]["message"].startswith("messages: rendering them needs more memory than the chat renderer may "
                                          "use") and f"({CAP_MIB} MiB)" in bomb[-1]["message"], bomb[-1]
    assert output(good) == alone, good
    assert process.num_starts == starts + 1  # (the bomb's child ended; the good chat's is fresh)
    assert not node.engine.check_integrity()


def test_a_chat_whose_render_hangs_fails_alone_and_a_chat_sent_meanwhile_is_served(node: CacheNode) -> None:
    """The child stops (SIGSTOP: as a render that never ends would hold it) while tenant
    evil's chat renders, and tenant good's chat is sent meanwhile: evil's fails at the render
    timeout (1 s here), naming it; good's waits for it and is served on a fresh child, its
    tokens those it gets alone."""
    process, alone = capped_child(node)
    pid, timeout = process.pid, process.render_timeout_s
    assert pid is not None

    async def together() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        os.kill(pid, signal.SIGSTOP)
        hung = asyncio.create_task(events(node, chat("hung", "evil", QUESTION)))
        await asyncio.sleep(0.05)
        good = asyncio.create_task(events(node, chat("good-with-hung", "good", QUESTION)))
        return await hung, await good

    process.render_timeout_s = 1.0
    try:
        hung, good = asyncio.run(together())
    finally:
        process.render_timeout_s = timeout
    assert hung[-1]["type"] == "error" and "did not answer within 1 s" in hung[-1]["message"], hung[-1]
    assert output(good) == alone, good[-1]
    assert process.pid not in (None, pid)


def test_an_abort_of_the_render_child_not_about_memory_is_internal_and_a_chat_sent_meanwhile_is_served(
        node: CacheNode) -> None:
    """The child, under its memory cap, dies by SIGABRT while tenant evil's small chat renders
    (a signal from outside: nothing about memory, its stderr says no allocation failed), and
    tenant good's chat is sent meanwhile. Regression (s41): every SIGABRT under the cap was
    taken for an allocation past it, and evil's chat was refused INVALID_ARGUMENT "messages:
    rendering them needs more memory" (its client told to send less, not to retry). Now
    INTERNAL naming the signal, "send this one again"; good's chat is served on a fresh child,
    its tokens those it gets alone."""
    process, alone = capped_child(node)
    pid, starts = process.pid, process.num_starts
    assert pid is not None

    async def together() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        os.kill(pid, signal.SIGSTOP)  # (held mid-render: the abort lands while it serves evil's chat)
        aborted = asyncio.create_task(events(node, chat("aborted", "evil", QUESTION)))
        await asyncio.sleep(0.2)
        good = asyncio.create_task(events(node, chat("good-with-abort", "good", QUESTION)))
        await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGABRT)
        os.kill(pid, signal.SIGCONT)
        return await aborted, await good

    aborted, good = asyncio.run(together())
    assert aborted[-1]["type"] == "error", aborted[-1]
    assert aborted[-1]["code"] == "INTERNAL", aborted[-1]
    assert "killed by signal 6" in aborted[-1]["message"] and "send this one again" in aborted[-1]["message"]
    assert "memory" not in aborted[-1]["message"], aborted[-1]
    assert output(good) == alone, good[-1]
    assert process.pid not in (None, pid) and process.num_starts == starts + 1
    assert not node.engine.check_integrity()



@pytest.mark.parametrize(("lines", "memory"), [
    (["memory allocation of 17039360 bytes failed",
      "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace"], True),  # (as seen above)
    (["memory allocation of 64 bytes failed", "Fatal Python error: Aborted", "",
      "Current thread 0x1 (most recent call first):", 'File "x.py", line 1 in render'], True),  # a fault handler's report of the abort after it
    (["terminate called after throwing an instance of 'std::bad_alloc'", "what():  std::bad_alloc"], True),
    (["Fatal Python error: Aborted", "Current thread 0x1 (most recent call first):"], False),
    (["memory allocation of 64 bytes failed", "a later line: it went on"], False),  # not its last words
    (["chat renderer: the warm-up render was refused (ValueError); going on"], False),
    ([], False),
])
def test_only_a_failed_allocations_last_words_make_an_abort_the_requests_size(lines: list[str],
                                                                              memory: bool) -> None:
    assert _died_of_memory([line.strip() for line in lines if line.strip()]) is memory
