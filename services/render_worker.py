"""A cache node's chat renderer process (``python -m services.render_worker``), and its wire.

A cache node renders chat requests' messages with the model's chat template and tokenizes
them here, not in its own process: a render is pure-Python work (jinja) that holds the GIL,
and in the node's process it took the GIL from the step thread. Regression (review s35 E F3):
one tenant sending 1000-message chats back to back (each render ~40-240 ms) slowed every
other tenant's decoding ~3-4x (inter-token median 5.3 -> 21.8 ms on the tiny model, CPU),
although the node's render queue takes tenants in turn. ``services.render_process`` is the
node's side.

The process loads the tokenizer and its chat template alone (from a directory the node saved
them to: ``PreTrainedTokenizerBase.save_pretrained``), never the model, and not torch
(``NOT_IMPORTED``): ~1-2 s of CPU time to start.

The wire is ``cache_node.grammar_worker``'s: frames of a 4-byte big-endian length and a
msgpack array, requests on the child's stdin, replies on a copy of its stdout (fd 1 itself is
pointed at stderr). Token ids cross as ``array('i')`` bytes (native int32).

- first, parent -> child: ``["init", tokenizer_dir, memory_bytes]``; the child caps its data
  segment (``RLIMIT_DATA``) at ``memory_bytes`` (0: no cap) before it loads anything (``MEMORY_BYTES``
  is the parents' bound), then answers ``["ready", sandbox_report]`` once the tokenizer is
  loaded and its template has rendered once (the report: ``cache_node.sandbox.confine``'s; the
  process confines itself then), or ``["failed", "memory", message]`` (and ends) when loading
  them ran past the cap.
- then per render, parent -> child: ``["first_turn", messages, tools]`` or
  ``["continue_session", history_messages, history_ids, messages, tools, same_tools,
  tool_reply]`` (``ChatTemplater.first_turn`` / ``continue_session``; ``tools`` None or the
  JSON text of a list of OpenAI tool dicts, ``tool_reply`` None or a string); child -> parent
  ``["ok", ids, continued]`` or ``["error", kind, message]``, ``kind`` one of ``ERROR_KINDS``.
- or parent -> child ``["render", json_utf8]``, the JSON text of ``[messages,
  add_generation_prompt, tools]`` (``ChatTemplater.render``'s arguments: JSON, as they came
  off the wire, so an integer past 64 bits or a float crosses exactly) as msgpack bin, UTF-8
  with lone surrogates passed (``surrogatepass``) and non-ASCII characters unescaped (diff
  review s36 R2 F2: ``\\u`` escapes cost the gateway's thread ~9x the GIL time of an
  in-process render of a 1 Mi-emoji chat); child -> parent
  ``["text", utf8]`` (the rendering, UTF-8 with lone surrogates passed: ``surrogatepass``) or
  ``["error", kind, message]`` (the gateway's renders: ``services.gateway_render``).

The child runs at niceness ``WORKER_NICENESS`` once loaded; it ends when its stdin closes and
when its parent dies (``grammar_worker._die_with_parent``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from array import array
from typing import Any, BinaryIO

import msgpack

from cache_node.grammar_worker import (
    HEADER_BYTES,
    _cap_files,
    frame,
    header_size,
    read_frame_blocking,
    run_child,
)
from cache_node.sandbox import confine
from services.chat import TemplateRefusal

MAX_REQUEST_BYTES = 256 << 20
"""Largest request frame the child reads (a session turn carries its kept messages and its
history's token ids; the node bounds both)."""

ERROR_KINDS = ("TemplateRefusal", "ValueError", "TypeError", "KeyError", "memory", "internal")
"""How a render failed: the request's fault (the first four, raised again as such by the
parent, ``services.render_process``; ``memory``: it needed more than the child's memory cap,
``MEMORY_BYTES``: the parent refuses the request and starts a fresh child) or the parent's
(``internal``: the template itself is broken, ...)."""

MEMORY_BYTES = 1 << 30
"""The child's data segment cap (``RLIMIT_DATA``, bytes), set before the tokenizer loads, so it
covers it. Measured (SmolLM2, this host): ready, VmData is 124 MiB (the interpreter,
transformers' import, the tokenizer; a cap of 128 MiB aborts the load); the gateway's largest
renders (``render``: 1,024 messages or one message of 1 Mi characters, 1.3 MB of tools' JSON,
1 MB of tool-call arguments) add ~1 MiB, and a node's ``first_turn`` of 1 Mi characters, which
tokenizes too, comes to 213 MiB. 1 GiB leaves ~4.5 times that, for a larger vocabulary (a
128K-token tokenizer's ~10 MB ``tokenizer.json``) and a heavier template. Past it a render
fails alone: ``MemoryError`` in Python (a ``memory`` reply), an allocation of the tokenizer's
(Rust) aborts the child (SIGABRT); either way the parent starts a fresh child for the next
render. Without it, one tenant's render (a template that multiplies its input) could take the
host's memory."""

MAX_TEXT_BYTES = 48 << 20
"""Longest rendering a ``render`` reply carries (UTF-8 bytes): past it the request is refused
(``TemplateRefusal``, as a template's own refusal: such a prompt comes to millions of tokens,
past every context, and in process it was tokenized first), its reply staying within the
parent's ``MAX_REPLY_BYTES``."""

MAX_ERROR_CHARS = 2048
"""Longest error message sent (longer ones are cut)."""

NOT_IMPORTED = ("torch",)
"""Not imported by the child (transformers' tokenizers go on without it): ~6 s of a loaded
host's start, and ~400 MiB."""

WORKER_NICENESS = 5
"""The child's CPU priority once loaded: a render yields the CPU to the node's step thread when
both want the same core, without being starved by it (renders are bounded work, and a chat
request's first token waits for its render)."""


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, WORKER_NICENESS)
    except (AttributeError, OSError):  # not here, or not permitted: at the node's priority
        pass


def load_templater(tokenizer_dir: str) -> Any:
    """A ``services.chat.ChatTemplater`` of the tokenizer saved in ``tokenizer_dir``, torch not
    imported (``NOT_IMPORTED``)."""
    for name in NOT_IMPORTED:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # (its import raises ImportError)
    from transformers import AutoTokenizer

    from services.chat import ChatTemplater

    return ChatTemplater(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True))


def _ids(data: bytes) -> list[int]:
    ids = array("i")
    ids.frombytes(data)
    return ids.tolist()


def _tools(text: Any) -> Any:
    """A request's tools: JSON text (``render_process._tools_text``) or None."""
    return json.loads(text) if isinstance(text, str) else text


def _render_text(templater: Any, payload: bytes) -> list[Any]:
    """A ``render`` request's reply: the rendering of ``payload`` (JSON text of ``[messages,
    add_generation_prompt, tools]``, UTF-8 with lone surrogates passed) as UTF-8, within
    ``MAX_TEXT_BYTES``."""
    messages, add_generation_prompt, tools = json.loads(payload.decode("utf-8", "surrogatepass"))
    text = templater.render(messages, bool(add_generation_prompt), tools)
    data = text.encode("utf-8", "surrogatepass")
    if len(data) > MAX_TEXT_BYTES:
        raise TemplateRefusal(f"messages: they render to {len(data)} bytes of text; at most {MAX_TEXT_BYTES} are "
                              "rendered (a prompt of millions of tokens)")
    return ["text", data]


def render(templater: Any, request: list[Any]) -> list[Any]:
    """The reply to one render ``request`` (see the module docstring)."""
    try:
        if request[0] == "render" and len(request) == 2 and isinstance(request[1], bytes):
            return _render_text(templater, request[1])
        if request[0] == "first_turn" and len(request) == 3:
            ids, continued = templater.first_turn(request[1], _tools(request[2])), False
        elif request[0] == "continue_session" and len(request) == 7:
            _, kept, history, messages, tools, same_tools, tool_reply = request
            ids, continued = templater.continue_session(kept, _ids(history), messages, _tools(tools),
                                                        bool(same_tools), tool_reply)
        else:
            return ["error", "internal", f"unknown render request {str(request[0])[:64]!r}"]
        return ["ok", array("i", ids).tobytes(), bool(continued)]
    except MemoryError:
        return ["error", "memory", "rendering them needs more memory than the chat renderer may use"]
    except Exception as exc:  # noqa: BLE001 - each is the request's or the template's, said so
        kind = type(exc).__name__
        if kind not in ERROR_KINDS or not isinstance(exc, (ValueError, TypeError, KeyError)):
            return ["error", "internal", f"{kind}: {exc}"[:MAX_ERROR_CHARS]]
        return ["error", kind, str(exc)[:MAX_ERROR_CHARS]]


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """Answer render requests until ``requests`` ends (see the module docstring)."""
    body = read_frame_blocking(requests, MAX_REQUEST_BYTES)
    if body is None:
        return
    kind, tokenizer_dir, memory_bytes = msgpack.unpackb(body, raw=False)
    if kind != "init":
        raise ValueError(f"expected an init frame, got {kind!r}")
    cap_memory(int(memory_bytes))  # before the tokenizer loads: the cap covers it
    try:
        templater = load_templater(tokenizer_dir)
        try:  # the template compiled, lazy imports done
            templater.first_turn([{"role": "user", "content": "x"}])
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template that refuses a lone user message (one asking
            # for a system message first) still renders the chats it takes (diff review s35 R4)
            print(f"chat renderer: the warm-up render was refused ({type(exc).__name__}); going on", file=sys.stderr)
    except MemoryError as exc:  # (the parent names the cap, and backs off: ``render_process.StartGuard``)
        templater, why = None, f"MemoryError: {exc}"[:MAX_ERROR_CHARS]
    if templater is None:  # (what the load held is freed now)
        replies.write(frame(["failed", "memory", why]))
        replies.flush()
        return
    _cap_files()
    _lower_priority()
    sandbox = confine(os.getcwd())  # from here on, tenants' messages
    replies.write(frame(["ready", sandbox]))
    replies.flush()
    while True:
        try:
            body = read_request(requests, MAX_REQUEST_BYTES)
            if body is None:
                return
            reply = frame(render(templater, msgpack.unpackb(body, raw=False)))
        except MemoryError:  # its frame (the request's, the reply's) past the cap
            reply = frame(["error", "memory", "rendering them needs more memory than the chat renderer may use"])
        body = None
        replies.write(reply)
        replies.flush()


def read_request(stream: BinaryIO, max_bytes: int) -> bytearray | None:
    """The next frame's body from ``stream`` (None at its end), as ``read_frame_blocking``
    reads it, but read past whole when it does not fit under the memory cap: the next read is
    the next frame's.

    Raises:
        MemoryError: the body did not fit (the frame has been read past: the request's size
            refusal, as a render past the cap is). Regression (task s40): the body was read
            outside ``serve``'s ``try``, and a frame past the cap ended the child with exit
            status 1 (the request answered INTERNAL, not ``RenderTooLarge``).
        ValueError: the frame declares more than ``max_bytes``, or the stream ends inside it.
    """
    header = stream.read(HEADER_BYTES)
    if not header:
        return None
    if len(header) < HEADER_BYTES:
        raise ValueError("the stream ended inside a frame header")
    size = header_size(header)
    if size > max_bytes:
        raise ValueError(f"a frame of {size} bytes; at most {max_bytes}")
    got = 0
    try:
        body = bytearray(size)
        view = memoryview(body)
        while got < size:
            n = stream.readinto(view[got:])
            if not n:
                raise ValueError("the stream ended inside a frame")
            got += n
    except MemoryError:
        view = body = None  # (freed before the rest is read past)
        _skip(stream, size - got)
        raise
    view.release()
    return body


def _skip(stream: BinaryIO, size: int) -> None:
    """Read ``size`` bytes of ``stream`` past, 64 KiB at a time.

    Raises:
        ValueError: the stream ends before them."""
    while size > 0:
        chunk = stream.read(min(size, 64 << 10))
        if not chunk:
            raise ValueError("the stream ended inside a frame")
        size -= len(chunk)


def cap_memory(memory_bytes: int) -> None:
    """``RLIMIT_DATA`` (soft) at ``memory_bytes`` (``MEMORY_BYTES``), within the hard limit; 0: no
    cap. Past it an allocation fails: Python raises ``MemoryError`` (a ``memory`` reply)."""
    if memory_bytes <= 0:
        return
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes if hard == resource.RLIM_INFINITY
                                              else min(memory_bytes, hard), hard))


def main() -> None:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no Rust thread pool (``cache_node.sandbox``: one thread)
    run_child(serve)


if __name__ == "__main__":
    main()
