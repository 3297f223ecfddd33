"""The gateway's chat renders: small ones in its process, large ones in render children
(``GatewayTemplater``, ``RenderPool``).

The gateway renders chats (its ``first_turn``, a session turn's size estimates, a
``prefix_messages`` prefix, an HTTP body's shared render, ``/tokenize``) on its worker threads
(``InferenceServicer.off_loop``: one turn per tenant), all through ``ChatTemplater.render``.
A render is pure-Python jinja that holds the GIL, which the gateway's event loop, serving
every tenant's calls and streams, needs too. Regression (review s35 E F3, "other places"):
one tenant's 1000-message chats took the GIL from every other tenant's requests at the
gateway (renders in its process).

``GatewayTemplater.render`` renders a chat in this process when it is small
(``IN_PROCESS_MESSAGES`` messages and ``IN_PROCESS_CHARS`` characters of JSON at most: a
render of ~1 ms, less than handing it to a child costs), else in a child of ``RenderPool``
(``services.render_process.RenderProcess``, ``owner="gateway"``: the cache node's renderer
child, ``render`` requests); its text is tokenized here as before (``ChatTemplater.encode``:
the tokenizer's Rust code runs without the GIL). Renders through a child give the same text
as in this process (the messages and tools cross as JSON text, as they came off the wire:
an integer past 64 bits crosses exactly), so the same token ids.

The pool holds at most ``RENDER_CHILDREN`` children, one per worker thread: a worker thread
runs one tenant's turn at a time, so no tenant holds two children and no render waits for a
child another tenant's render holds. Had every child a render under way (a caller off the
worker threads), a render waits for the next free one, in the order they asked (FIFO).
Regression (diff review s35 of 2adbb9d, R3): all of a gateway's renders went to one shared
child, so a 1-message chat waited 2,787 ms behind another tenant's 3000-message chat (1 ms
before).

A tokenizer that cannot be saved for a child (``save_pretrained`` fails: a tokenizer class of
its own) leaves every render in the gateway's process, as before (logged once).

Children start on the first large render that finds none free (~1-3 s, paid by that render;
no gateway start pays it) and live until ``close`` (the gateway's ``stop``), after which a
large render fails (``RenderFailed``) and none starts (R5 of that review: a render after stop
started a new child). A child that ends, hangs past its timeout or answers out of protocol
fails only the render under way (``RenderFailed``: the gateway's fault, INTERNAL) and is
started again by the next render it takes; one past its memory cap
(``render_worker.MEMORY_BYTES``) fails it with ``RenderTooLarge`` (a ``TemplateRefusal``:
INVALID_ARGUMENT / HTTP 400 naming ``messages``), and restarts.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from typing import Any

from services.chat import ChatTemplater, Messages
from services.gateway import TOKENIZER_THREADS
from services.render_process import RenderFailed, RenderProcess

log = logging.getLogger(__name__)

IN_PROCESS_MESSAGES = 32
"""Most messages a chat rendered in the gateway's own process may have. Measured (SmolLM2's
template, this 2-core host, best of 5): 32 messages of 100 characters render in 0.54 ms, 64 in
1.05 ms, 1,000 in 15.8 ms (a template's cost grows with the messages it loops over)."""

IN_PROCESS_CHARS = 16 << 10
"""Most characters of JSON (the messages, tools included: ``json.dumps`` of the render's
arguments) a chat rendered in the gateway's own process may have. Measured as above: 64 tools
(27.5K characters of JSON) render in 3.4 ms, 16 (6.9K) in 0.9 ms, through a template that
writes them with ``tojson`` (its cost grows with the tools' values); a message's plain text is
cheaper (1 Mi characters in one message: 0.3 ms) but is bounded so too: its JSON is what is
sent to a child otherwise."""

RENDER_CHILDREN = TOKENIZER_THREADS
"""Most render children a gateway runs: one per worker thread (``InferenceServicer.off_loop``),
each of which runs one tenant's turn at a time. Each child holds ~125 MiB (its tokenizer and
transformers' import: ``render_worker.MEMORY_BYTES``)."""


class RenderPool:
    """At most ``size`` render children for ``tokenizer`` (``RenderProcess``, ``owner="gateway"``),
    each rendering one chat at a time; made on demand, until ``close``.

    Args:
        tokenizer: the gateway's tokenizer (saved by each child's ``RenderProcess``).
        size: the most children (``RENDER_CHILDREN``).
        process_args: more arguments for each ``RenderProcess`` (tests: timeouts, ``memory_bytes``).
    """

    def __init__(self, tokenizer: Any, size: int = RENDER_CHILDREN, **process_args: Any) -> None:
        if size < 1:
            raise ValueError(f"a render pool needs at least one child; got {size}")
        self.tokenizer = tokenizer
        self.size = size
        self.process_args = process_args
        self.processes: list[RenderProcess] = []  # every child made (``close`` stops them)
        self.waits = 0  # renders that found every child busy and waited for one
        self.closed = False
        self.unsaved: Exception | None = None  # why the tokenizer could not be saved for a child (none is made)
        self._idle: list[RenderProcess] = []
        self._making = 0  # children being made (counted against ``size``)
        self._queue: collections.deque[object] = collections.deque()  # tickets of waiting renders, FIFO
        self._cond = threading.Condition()

    def render(self, payload: str) -> str:
        """``RenderProcess.render_text(payload)`` in a free child (waiting for one, in turn, when
        all ``size`` are busy). Raises what that raises; ``RenderFailed`` once ``close``d."""
        process = self._take()
        try:
            return process.render_text(payload)
        finally:
            with self._cond:
                if not self.closed:
                    self._idle.append(process)
                self._cond.notify_all()

    def _take(self) -> RenderProcess:
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            waited = False
            try:
                while not self.closed and not (self._queue[0] is ticket and (
                        self._idle or len(self.processes) + self._making < self.size)):
                    waited = True
                    self._cond.wait()
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may go now
            if self.closed:
                raise RenderFailed("the gateway is stopping: its chat renderer processes are stopped")
            self.waits += waited
            if self._idle:
                return self._idle.pop()  # the one used last: warm
            self._making += 1
        try:
            process = RenderProcess(self.tokenizer, owner="gateway", **self.process_args)
        except BaseException as exc:
            with self._cond:
                self._making -= 1
                self._cond.notify_all()
            if isinstance(exc, Exception) and self.unsaved is None:  # (``save_pretrained``'s: it stays so)
                self.unsaved = exc
                log.warning("gateway: chats render in the gateway's process (its tokenizer could not be saved for "
                            "a render child: %s: %s)", type(exc).__name__, exc)
            raise
        with self._cond:
            self._making -= 1
            if not self.closed:
                self.processes.append(process)
                return process
        process.close()  # (closed while it was made: it never starts a child)
        raise RenderFailed("the gateway is stopping: its chat renderer processes are stopped")

    def close(self) -> None:
        """Stop every child (a render under way fails, ``RenderFailed``); no render starts one
        from now on (any thread; idempotent)."""
        with self._cond:
            self.closed = True
            processes, self._idle = list(self.processes), []
            self._cond.notify_all()
        for process in processes:
            process.close()


class GatewayTemplater(ChatTemplater):
    """The gateway's ``ChatTemplater``: ``render`` in this process for a small chat, else in a
    child of its ``pool`` (see the module docstring); everything else as ``ChatTemplater``.

    Args:
        tokenizer: the gateway's tokenizer, with its chat template.
        pool: the children's pool (None: a ``RenderPool`` of ``RENDER_CHILDREN``).
        in_process_messages / in_process_chars: the bounds of a chat rendered here.
    """

    def __init__(self, tokenizer: Any, pool: RenderPool | None = None,
                 in_process_messages: int = IN_PROCESS_MESSAGES, in_process_chars: int = IN_PROCESS_CHARS) -> None:
        super().__init__(tokenizer)
        self.pool = pool if pool is not None else RenderPool(tokenizer)
        self.in_process_messages = in_process_messages
        self.in_process_chars = in_process_chars
        self.child_renders = 0  # renders sent to a child

    def render(self, messages: Messages, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """``ChatTemplater.render``, in a child when the chat is not small (raises what it
        raises, ``RenderTooLarge``, and ``RenderFailed`` where the child failed or the gateway
        stopped)."""
        try:
            payload = json.dumps([list(messages), bool(add_generation_prompt), tools or None])
        except (TypeError, ValueError):  # not JSON (never from an edge: they take JSON and protobuf)
            log.warning("gateway: a chat whose values are not JSON renders in the gateway's process", exc_info=True)
            return super().render(messages, add_generation_prompt, tools)
        if (len(messages) <= self.in_process_messages and len(payload) <= self.in_process_chars) \
                or self.pool.unsaved is not None:  # (no child can load this tokenizer: here, as before)
            return super().render(messages, add_generation_prompt, tools)
        self.child_renders += 1
        try:
            return self.pool.render(payload)
        except Exception:
            if self.pool.unsaved is None:
                raise
        self.child_renders -= 1
        return super().render(messages, add_generation_prompt, tools)

    def close(self) -> None:
        """Stop the render children (the gateway's ``stop``); a later large render fails."""
        self.pool.close()
