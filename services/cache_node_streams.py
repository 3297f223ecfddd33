"""A cache node's token streams: how each engine step's events reach their requests.

Each engine step's events are handed from the step thread to the event loop in one batch, and
reach a request in one of two ways: ``generate`` (in-process callers: an async generator over
the request's own queue) or, for a stream opened by ``submit``, pushed by the step thread to
its gateway's event inbox, one message per gateway per step (split where it would not fit
``EVENT_LIMITS``, ``PushSockets.send_events``). A request's ``started`` event is
sent when the engine first schedules it, before that step's forward pass.

Stop strings (``SamplingParams.stop``) are matched here, where the output is detokenized
(``cache_node.stop_strings.StopMatcher``): a delta's text holds back a tail that could begin a
stop string; the token whose text completes one ends the request in the engine at once, with
finish_reason "stop" (before the next step: no token after it is generated), and the text is
cut before the stop string; a chat session's history keeps the tokens of the cut text alone
(``Streams._cut_session_history``), a token-id session's ends with that token. A tail still held back
when the request ends otherwise goes out as a last delta without token ids. A character whose
bytes span tokens is held back until its last token (its first bytes decode as U+FFFD). The
output is detokenized incrementally (``cache_node.detokenizer``): a step decodes the last few
tokens, not the whole output, and sends exactly what decoding the whole output would. A
request asking for log probabilities gets them in its deltas, one entry per token id
(``services.node_request.logprobs_entry``), whatever text the delta holds back; one asking
for prompt logprobs gets them in deltas with no token id as its prompt's chunks compute
(``services.node_request.prompt_logprobs_entry``, ``PROMPT_LOGPROBS_PER_EVENT`` a delta), all
before its first token's.

A request's last output and an abort each claim its stream once (``_deliver_step``): a
session turn cancelled while the step that finished it computed is undone in the engine too, so
a session's token history and its kept messages always hold the same turns.

``Streams`` is a part of ``services.cache_node.CacheNode``; it uses the node's ``engine``,
``_streams``, ``_session_turns``, ``_pusher``, ``_outbox``, ``_incoming`` and ``_wake``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from cache_node.detokenizer import IncrementalDetokenizer
from cache_node.outputs import RequestOutput
from cache_node.stop_strings import StopMatcher
from services.chat import ChatTemplater, Messages, content_chars, encode_text
from services.chat_tools import check_tool_output, template_call
from services.node_request import NodeRequest, logprobs_entry, prompt_logprobs_entry
from services.render_process import RemoteTemplater, RenderFailed, RenderProcess, TokenizerUnsaved
from services.tool_calls import ToolOutput  # (the edge's reader: no web stack, review 29i F6)

Event = dict[str, Any]

log = logging.getLogger(__name__)


class SessionTexts:
    """The chat messages each session on this node keeps to render its next turn
    (``ChatTemplater.continue_session``), the tools its history was rendered with (JSON text,
    ``NodeRequest.tools``), the text of its last reply when that was kept as tool calls (the
    model's own text, which the history's tokens hold: ``tool_reply``), and the characters of
    their text (messages, tool calls and tools) per session and per tenant (``CacheNode``
    bounds both before a turn starts: ``NodeConfig.max_session_text_chars_per_tenant``).

    Read on the renderer thread, changed on the step thread (a dict's ``get`` and one turn's
    ``add`` are each atomic under the GIL, as before this class)."""

    def __init__(self) -> None:
        self._messages: dict[str, list[dict[str, str]]] = {}
        self._owner: dict[str, tuple[str, int]] = {}  # session -> (tenant, its characters)
        self._tools: dict[str, str] = {}  # session -> its history's tools (absent: none)
        self._tool_reply: dict[str, str] = {}  # session -> its last reply's text, kept as tool calls
        self.tenant_chars: Counter[str] = Counter()

    def get(self, session_id: str, default: Any = None) -> Any:
        return self._messages.get(session_id, default)

    def __getitem__(self, session_id: str) -> list[dict[str, str]]:
        return self._messages[session_id]

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._messages

    def __len__(self) -> int:
        return len(self._messages)

    def chars(self, session_id: str) -> int:
        """Characters of the text ``session_id`` keeps (0: none), its tools' included."""
        owner = self._owner.get(session_id)
        return owner[1] if owner is not None else 0

    def tools(self, session_id: str) -> str:
        """The tools (JSON text; "" none) ``session_id``'s history was rendered with."""
        return self._tools.get(session_id, "")

    def tool_reply(self, session_id: str) -> str | None:
        """The text the model generated for ``session_id``'s last reply when it is kept as tool
        calls (None: it is kept as that text)."""
        return self._tool_reply.get(session_id)

    def added_chars(self, session_id: str, messages: Messages, tools: str) -> int:
        """Characters a turn of ``messages`` rendered with ``tools`` adds to what ``session_id``
        keeps (other tools replace its tools)."""
        return content_chars(messages) + len(tools) - len(self.tools(session_id))

    def add(self, session_id: str, tenant: str, messages: Messages, tools: str = "",
            tool_reply: str | None = None) -> None:
        """Append one turn's ``messages`` (rendered with ``tools``; its reply kept as tool calls:
        ``tool_reply``, the text generated) to ``session_id``'s history, charged to ``tenant``."""
        added = self.added_chars(session_id, messages, tools)
        owner, chars = self._owner.get(session_id, (tenant, 0))
        self._messages.setdefault(session_id, []).extend(messages)
        self._owner[session_id] = (owner, chars + added)
        self.tenant_chars[owner] += added
        if tools:
            self._tools[session_id] = tools
        else:
            self._tools.pop(session_id, None)
        if tool_reply is not None:
            self._tool_reply[session_id] = tool_reply
        else:
            self._tool_reply.pop(session_id, None)

    def pop(self, session_id: str, default: Any = None) -> Any:
        """Forget ``session_id``'s messages (closed or expired); returns them, or ``default``."""
        owner = self._owner.pop(session_id, None)
        self._tools.pop(session_id, None)
        self._tool_reply.pop(session_id, None)
        if owner is not None:
            self.tenant_chars[owner[0]] -= owner[1]
            if self.tenant_chars[owner[0]] <= 0:
                del self.tenant_chars[owner[0]]
        return self._messages.pop(session_id, default)


@dataclass(eq=False)
class _Stream:
    """One request's stream: in-process (``deliver`` called on ``loop``) or, with a
    ``subscriber``, pushed by the step thread to that gateway's event inbox. ``detok``: its
    output's text (made at its first token); ``sent``: the text sent, in pieces (cut before a
    stop string)."""

    loop: asyncio.AbstractEventLoop | None
    deliver: Callable[[Event], None] | None
    request: NodeRequest
    prompt_tokens: int
    subscriber: str = ""
    detok: IncrementalDetokenizer | None = None
    sent: list[str] = field(default_factory=list)
    started: bool = False
    stops: StopMatcher | None = None
    generated: int = 0  # tokens generated so far (stop strings wait for ``min_tokens`` of them)
    first_token_s: float | None = None  # this node's clock, when its first token went out
    # (its session's history, the session's message count, its prompt's token ids or the
    # error rendering it raised) as the renderer made them (``Streams._render``); None: not
    # rendered ahead
    rendered: tuple[list[int] | None, int, list[int] | Exception] | None = None
    history: list[int] | None = None  # its session's history when it started (None: none)
    rerenders: int = 0  # times its render went stale and it was queued to render again

    def __post_init__(self) -> None:
        if self.request.sampling.stop:
            self.stops = StopMatcher(self.request.sampling.stop)


class Streams:
    """The stream part of ``CacheNode``: opening streams and delivering their events."""

    # ---- streaming generation -------------------------------------------------------------
    def _open(self, stream: _Stream) -> _Stream | None:
        """Register a stream and hand it to the step thread, which queues its request in the
        engine before its next step (``_start_incoming``); a refusal (INVALID_ARGUMENT,
        PERMISSION_DENIED) arrives as an error event on the stream. Returns None, or, when a
        stream of its request id is open already, that stream (``stream`` is not opened: the
        check and the registering are one step under ``_streams_lock``). Once the node shut
        down (``CacheNode.shutdown``), ``stream`` gets its last event at once, UNAVAILABLE
        (``_end_shut_down``), and is not opened."""
        with self._streams_lock:
            running = self._streams.get(stream.request.request_id)
            if running is not None:
                return running
            stopped = self._stopped  # (``shutdown`` sets it under this lock)
            if not stopped:
                self._streams[stream.request.request_id] = stream
        if stopped:
            self._end_shut_down(stream)
            return None
        if stream.request.messages and self.templater is not None and self._queue_render(stream):
            return None
        self._incoming.append(stream)
        self._wake.set()
        return None

    def _claim(self, stream: _Stream) -> bool:
        """Take ``stream`` out of ``_streams`` if it is still there: the claim on its request's
        end, which exactly one gets of its last output (``_deliver_step``), an abort
        (``Commands.abort``, ``_end_stream``), an error event (``_dispatch``, ``_deliver``)
        and its in-process consumer leaving (``generate``). False: another claimed it first,
        whatever stream of its id opened since (that one stays).

        The check and the pop are one step under ``_streams_lock``. Regression (s40): they
        were two, on different threads: an abort and a new request of the same id landing
        between them (on the event loop) had the step thread pop the new stream as the old
        request's last output was handed over: the new stream got the old request's
        ``finished`` and its own request never started."""
        request_id = stream.request.request_id
        with self._streams_lock:
            if self._streams.get(request_id) is not stream:
                return False
            del self._streams[request_id]
            return True

    def _end_shut_down(self, stream: _Stream) -> None:
        """The node shut down: ``stream``, claimed or never opened, gets its last event,
        UNAVAILABLE (an in-process one on its loop, if that still runs; a gateway's is queued
        in the outbox, which no step thread sends any more)."""
        event = {"type": "error", "code": "UNAVAILABLE",
                 "message": f"cache node {self.node_id} is shut down; retry the request"}
        if stream.subscriber:
            self._outbox.append((stream.subscriber, stream.request.request_id, event))
        elif stream.loop is not None and stream.deliver is not None:
            with contextlib.suppress(RuntimeError):  # its event loop is closed: no one waits
                stream.loop.call_soon_threadsafe(stream.deliver, event)

    def _claim_id(self, request_id: str) -> _Stream | None:
        """The stream open under ``request_id``, taken out of ``_streams`` (``_claim``); None
        when none is."""
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    def _queue_render(self, stream: _Stream) -> bool:
        """Queue a chat request for the renderer thread (``_render_next``), which hands it to
        the step thread when done; False when the renderer is shut down."""
        self._rendering.add(stream)
        with self._render_lock:
            self._render_queue.setdefault(stream.request.tenant, deque()).append(stream)
        try:
            self._renderer.submit(self._render_next)  # one task per queued stream
        except RuntimeError:  # shut down
            with self._render_lock:
                self._render_queue[stream.request.tenant].remove(stream)
            self._rendering.discard(stream)
            return False
        return True

    def _render_next(self) -> None:
        """Renderer thread: render the next chat request, round-robin over the tenants with
        requests waiting to render (``_render_queue``, first come first served within each).

        Regression (security review 20 S4): the renderer took requests first come first served
        across tenants: another tenant's small turn waited behind every render one tenant had
        queued (0.77 s behind 5 turns of ~4.3K tokens, 3.04 s behind 20).
        """
        with self._render_lock:
            tenant, queue = next(iter(self._render_queue.items()))
            stream = queue.popleft()
            del self._render_queue[tenant]
            if queue:  # to the back of the round
                self._render_queue[tenant] = queue
        self._render(stream)

    def _render(self, stream: _Stream) -> None:
        """Renderer thread: render and tokenize a chat request's prompt ahead of the step
        thread (``CacheNode._prompt_of`` uses it if its session has not changed since), in the
        render child (``_render_templater``; this thread waits for it without the GIL), then
        hand it to the step thread. A render the child failed (``render_process.RenderFailed``:
        it ended, hung or answered out of protocol) fails this request alone, INTERNAL.

        Regression (diff review): a session turn's messages were rendered and tokenized on
        the step thread (``_start_incoming``): a 640K-character turn of 7,900 tokens, which
        fits, stopped every stream on the node for ~1 s."""
        req = stream.request
        try:
            if self._streams.get(req.request_id) is stream:  # not aborted meanwhile
                # an opening turn has no history: a stale one here goes first (``_drop_stale_session``)
                session = req.session_id if not req.opens_session else ""
                count = len(self._session_messages.get(session, ())) if session else 0  # before the history: a
                history = self.engine.session_history(session) if session else None
                try:  # (in the render child: ``_render_templater``)
                    stream.rendered = (history, count, self._prompt(req, history, self._render_templater()))
                except Exception as exc:  # noqa: BLE001 - the step thread reports it (``_prompt_of``)
                    stream.rendered = (history, count, exc)
        except Exception:  # noqa: BLE001 - the step thread renders it again
            stream.rendered = None
        finally:  # regression: a close between leaving ``_rendering`` and reaching ``_incoming``
            # missed the turn, which then opened the closed session; now it is in one or both
            self._incoming.append(stream)
            self._rendering.discard(stream)
            self._wake.set()

    # ---- the render child -------------------------------------------------------------------
    def _start_render_child(self) -> None:
        """At the node's start: the renderer thread starts the render child ahead of the first
        chat request (``_render_templater``; a chat arriving meanwhile waits for it there)."""
        self._render_child: RemoteTemplater | None = None
        self._render_unsaved: Any = None  # a templater whose tokenizer could not be saved for a child
        self._render_closed = False
        if self.templater is not None:
            self._renderer.submit(self._warm_render_child)

    def _warm_render_child(self) -> None:
        try:
            templater = self._render_templater()
            if isinstance(templater, RemoteTemplater):
                templater.process.start()
        except Exception as exc:  # noqa: BLE001 - the first render starts it again
            if not self._render_closed:  # (a shutdown during the start: nothing to say)
                log.warning("cache node %s: %s: %s", self.node_id, type(exc).__name__, exc)

    def _render_templater(self) -> Any:
        """Renderer thread: the templater ``_prompt`` renders chat requests with: a
        ``RemoteTemplater`` for the node's ``templater``, whose renders run in a child process
        (``services.render_process``), made on first use and made again when ``templater`` was
        replaced; the node's own templater (rendering on this thread) where no child can render
        for it: a templater of another class than ``ChatTemplater``, or a tokenizer that cannot
        be saved for the child to load (logged once).

        Regression (review s35 E F3): renders ran on this thread and took the GIL from the step
        thread: one tenant sending 1000-message chats back to back slowed every other tenant's
        decoding ~3-4x (inter-token median 5.3 -> 21.8 ms, tiny model, CPU), though the render
        queue takes tenants in turn."""
        templater, child = self.templater, self._render_child
        if child is not None and child.local is templater:
            return child
        if child is not None:
            child.process.close()
            self._render_child = None
        if type(templater) is not ChatTemplater or templater is self._render_unsaved or self._render_closed:
            return templater
        try:
            process = RenderProcess(templater.tokenizer)
        except TokenizerUnsaved as exc:  # renders go on in this thread, as before
            log.warning("cache node %s: chat requests render in the node's process (its tokenizer could not be "
                        "saved for a render process: %s: %s)", self.node_id, type(exc).__name__, exc)
            self._render_unsaved = templater
            return templater
        except RenderFailed:  # passing (a full temp dir, no file descriptor left): this render fails
            raise
        except Exception as exc:  # any other failure to make one fails this render alone
            raise RenderFailed(f"the chat renderer could not be made ({type(exc).__name__}: {exc})") from exc
        self._render_child = RemoteTemplater(templater, process)
        if self._render_closed:  # (``_stop_renderer`` ran meanwhile)
            process.close()
        return self._render_child

    def _stop_renderer(self) -> None:
        """The node's shutdown: no more renders; the render child is killed (a render under way
        fails)."""
        self._render_closed = True
        self._renderer.shutdown(wait=False, cancel_futures=True)
        child = self._render_child
        if child is not None:
            child.process.close()

    async def generate(self, req: NodeRequest) -> AsyncIterator[Event]:
        """Run one request; yields event dicts (see services.node_request). Closing the
        generator before its last event aborts the request (at the next step boundary, on the
        step thread). A request whose id a request open here runs under already gets one
        error event, ALREADY_EXISTS, and that request is not touched.

        Regression (s40): a second ``generate`` of a running id replaced the first's stream
        (the first got no more events: its caller waited for ever), and closing a generator
        aborted whatever request the engine held under its id, from the event loop: once its
        stream was aborted and the id reused, the new request ended ``finished``/"abort"."""
        refused = self._aborted_early.pop(req.request_id, None)
        if refused is not None:  # as ``submit``'s
            yield {"type": "error", "code": refused[0], "message": refused[1]}
            return
        queue: asyncio.Queue[Event] = asyncio.Queue()
        stream = _Stream(asyncio.get_running_loop(), queue.put_nowait, req, 0)
        if self._open(stream) is not None:
            yield {"type": "error", "code": "ALREADY_EXISTS", "message": "a request with this id is running already"}
            return
        try:
            while True:
                event = await queue.get()
                yield event
                if event["type"] in ("finished", "error"):
                    break
        finally:  # left before its last event (claimed it, with its end): its own request is aborted
            if self._claim(stream):
                self._aborts.append((req.request_id, stream))  # (``Commands._run_aborts``)
                self._wake.set()

    def submit(self, req: NodeRequest, subscriber: str) -> None:
        """Start ``req``; its events go to ``subscriber`` (a gateway's event inbox address).

        A request refused at once (INVALID_ARGUMENT, PERMISSION_DENIED), cancelled before it
        arrived (``abort``: CANCELLED), of a session closed before it arrived (ABORTED,
        ``Commands._closing``), or whose id another gateway's request runs here already
        (ALREADY_EXISTS; ids are scoped to their tenant by the gateway), gets its error event
        pushed like any other event.

        Raises:
            ValueError: the same gateway's request of this id runs here already: a repeated
                submit (ids are per attempt, so no sound sender repeats one) is dropped, and
                counted by the caller, with no event. Regression (review 25a F): it was
                answered ALREADY_EXISTS under the running request's own id, so its gateway
                ended that request's call and released it while it ran on here to
                ``max_tokens``, unseen and unbilled.
        """
        error = self._aborted_early.pop(req.request_id, None)  # cancelled, or its session closed
        if error is None:
            running = self._open(_Stream(None, None, req, 0, subscriber))
            if running is None:
                return
            if running.subscriber == subscriber:
                raise ValueError(f"a repeated submit of running request {req.request_id!r}")
            error = ("ALREADY_EXISTS", "a request with this id is running already")
        # the running stream of that id is not touched
        self._outbox.append((subscriber, req.request_id, {"type": "error", "code": error[0], "message": error[1]}))
        self._wake.set()

    def _send_outbox(self) -> None:
        pushed: dict[str, list[list[Any]]] = {}  # each gateway's in their order
        while self._outbox:
            subscriber, request_id, event = self._outbox.popleft()
            pushed.setdefault(subscriber, []).append([request_id, event])
        for subscriber, items in pushed.items():
            self._pusher.send_events(subscriber, items)

    def _announce(self, batch: list[tuple[Any, int]]) -> None:
        """Step thread, after scheduling and before the forward pass: a ``started`` event for
        each request scheduled for the first time."""
        now = time.monotonic()
        events = []
        for seq, _ in batch:
            stream = self._owner(seq.request_id)
            if stream is None or stream.started:
                continue
            stream.started = True
            cached = dict(self.engine.tiers.cached_tokens_by_tier(seq))
            self.metrics.request_started(seq.num_prompt_tokens, cached)
            events.append((stream, {
                "type": "started", "request_id": seq.request_id, "node_id": self.node_id,
                "prompt_tokens": seq.num_prompt_tokens, "cached_tokens": cached,
                "queue_ms": (now - seq.arrival_time_s) * 1000.0, "priority": seq.priority,
            }))
        self._dispatch(events)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Turn one step's outputs into events and send them on: one message per gateway, one
        call per in-process event loop.

        A request's last output and an abort (``Commands.abort``, on the event loop) each
        claim its stream by taking it out of ``_streams``, and exactly one gets it: a turn
        whose last output claims it is finished (its session keeps it, with its messages, and
        its stream gets ``finished``); a session turn whose stream an abort claimed first
        (the abort landed while the step that finished it computed, or before its output got
        here) never happened, and its session is rewound (``_rewind_cancelled_turn``).

        Regression (hangs review N1): the engine finished such a turn in the step in flight,
        so its session's token history kept the cancelled turn (tokens its client never got)
        while the node's kept chat messages missed it, and later turns were rendered from
        messages that did not match the session's KV."""
        events = []
        for out in outputs:
            if not out.finished:
                stream = self._owner(out.request_id)
            else:
                if out.phase_s:  # it drew a token: its phases, whoever claims its stream (vLLM's histograms)
                    self.metrics.request_finished(out.phase_s, out.num_prompt_tokens, out.num_output_tokens)
                owner = self._engine_streams.pop(out.request_id, None)  # the engine is done with the id
                # the claim, this or an abort's, on the stream of this request alone (``_claim``)
                stream = owner if owner is not None and self._claim(owner) else None
                turn = self._session_turns.pop(out.request_id, None)
                if stream is None and turn is not None:
                    self._rewind_cancelled_turn(turn, out)
            if stream is not None:
                events.extend((stream, event) for event in self._events(out, stream))
        self._dispatch(events)

    def _owner(self, request_id: str) -> _Stream | None:
        """Step thread: the stream of the request the engine holds under ``request_id``, while
        it is still in ``_streams`` (None once an abort claimed it, whatever stream of the same
        id opened since: an output of the old request is not the new one's)."""
        stream = self._engine_streams.get(request_id)
        return stream if stream is not None and self._streams.get(request_id) is stream else None

    def _rewind_cancelled_turn(self, turn: _Stream, out: RequestOutput) -> None:
        """Step thread: ``out`` ended session turn ``turn``, cancelled before its end reached
        the client: a turn the engine finished (a finish other than abort, error or rejected)
        is undone (``LLMEngine.rewind_session``), so the session's history is again what it
        was before the turn, as its kept messages are."""
        if out.finish_reason in ("abort", "error", "rejected"):
            return  # the engine kept nothing of it
        req = turn.request
        if not self.engine.rewind_session(req.session_id, turn.history, turn.prompt_tokens, out.output_token_ids):
            log.warning("cache node %s: session %s changed before its cancelled turn %s could be undone",
                        self.node_id, req.session_id, req.request_id)

    def _dispatch(self, events: list[tuple[_Stream, Event]]) -> None:
        pushed: dict[str, list[list[Any]]] = {}
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Event]]] = {}
        for stream, event in events:
            if not stream.subscriber:
                batches.setdefault(stream.loop, []).append((stream, event))
                continue
            if event["type"] in ("finished", "error"):
                self._claim(stream)
            pushed.setdefault(stream.subscriber, []).append([stream.request.request_id, event])
        for subscriber, items in pushed.items():  # split to what its inbox decodes (EVENT_LIMITS)
            self._pusher.send_events(subscriber, items)
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list[tuple[_Stream, Event]]) -> None:
        for stream, event in batch:
            if event["type"] in ("finished", "error"):
                self._claim(stream)
            stream.deliver(event)

    def _events(self, out: RequestOutput, stream: _Stream) -> list[Event]:
        """Step thread: one step's output of ``stream``'s request as events (see the module
        docstring for stop strings)."""
        events: list[Event] = _prompt_logprobs_events(out)  # (each before the delta with the first token)
        stops = stream.stops
        if out.new_token_ids:
            if stream.first_token_s is None:
                stream.first_token_s = time.monotonic()
            delta = self._detokenize(stream, out.new_token_ids, out.finished)
            stream.generated += len(out.new_token_ids)
            if stops is not None:  # none in the text of the first min_tokens tokens (vLLM's)
                delta = stops.feed(delta, search=stream.generated > stream.request.sampling.min_tokens)
                if stops.stopped and not out.finished:  # this token completed a stop string
                    self.engine.abort_request(out.request_id, reason="stop")
            stream.sent.append(delta)
            event: Event = {"type": "delta", "token_ids": list(out.new_token_ids), "text": delta}
            if out.logprobs:  # (the request asked: SamplingParams.logprobs)
                event["logprobs"] = [logprobs_entry(lp.logprob, lp.top) for lp in out.logprobs]
            events.append(event)
        if out.finished and out.finish_reason == "rejected":  # (``error``: e.g. its grammar does not compile)
            refusal: Event = {"type": "error", "code": out.error_code or "INVALID_ARGUMENT",
                              "message": out.error or "the request can never fit this node's KV pool "
                                                      f"({self.engine.scheduler.pool_tokens} tokens)"}
            if out.retry_after_s:  # (the node's load: ``GrammarUnavailable``)
                refusal["retry_after_s"] = out.retry_after_s
            events.append(refusal)
        elif out.finished and out.finish_reason == "error":
            events.append({"type": "error", "code": "INTERNAL",
                           "message": "this request's step failed on the cache node (see its log); "
                                      "the node's other requests went on"})
        elif out.finished:
            tail = stops.flush() if stops is not None and out.finish_reason != "abort" else ""
            if tail:
                stream.sent.append(tail)
                events.append({"type": "delta", "token_ids": [], "text": tail})
            self._end_session_turn(stream, out)
            events.append(self._finished_event(out, stream))
        return events

    def _detokenize(self, stream: _Stream, token_ids: list[int], finished: bool) -> str:
        """The text ``token_ids`` add to ``stream``'s output ("" without a tokenizer): a
        character whose bytes span tokens is held back until its last token unless the output
        ends (regression: "ď" streamed as "\ufffd").

        Regression: the whole output was decoded again each step to find the new text, on
        the step thread: 0.76 ms per step per request at 512 output tokens, 18.4 ms at 8,000.
        Now a step decodes the last few tokens (``IncrementalDetokenizer``), whatever the
        output's length, and the text is still exactly the whole output's decode."""
        if self.tokenizer is None:
            return ""
        if stream.detok is None:
            stream.detok = IncrementalDetokenizer(partial(self.tokenizer.decode, skip_special_tokens=True))
        return stream.detok.add(token_ids, final=finished)

    def _end_session_turn(self, stream: _Stream, out: RequestOutput) -> None:
        req = stream.request
        if not req.session_id or out.finish_reason == "abort":
            return
        text = "".join(stream.sent)
        self._cut_session_history(stream, out, text)
        if not req.messages:
            return
        answer, tool_reply = _kept_reply(req.tool_output, text, out.finish_reason), None
        if "tool_calls" in answer:
            tool_reply = text
        self._session_messages.add(req.session_id, req.tenant, [*req.messages, answer], req.tools, tool_reply)

    def _cut_session_history(self, stream: _Stream, out: RequestOutput, text: str) -> None:
        """Step thread, at a session turn's end: make the session's history hold the tokens of
        the reply its client got (``text``), not the tokens generated past it
        (``reply_in_history``; ``LLMEngine.cut_session_turn`` frees their KV). A chat turn's
        history holds its reply as the chat template renders the kept message: no token that
        renders as nothing there (a special token other than the template's EOS, drawn as a
        stop token), and a last character cut in its bytes ("\ufffd") as that character's own
        tokens. A token-id turn's history is not cut: its client got every token id (each
        delta's ``token_ids``, the stop string's too: tokens in, tokens out), and its history
        ends with the token that completed a stop string (README, gRPC; review 30i F6: 29f6264
        cut it to the text, so a client keeping the ids it got held another history than the
        session, and tests/test_node_stop_strings.py's history check failed).

        Regression: a reply cut at a stop string kept the stop string's tokens (and the text of
        its last token past the cut) in the history while the client and the kept messages had
        the cut text, so the next turn attended to tokens the client never saw and answered
        otherwise than the same conversation sent without the session."""
        tokenizer, output, req = self.tokenizer, out.output_token_ids, stream.request
        if tokenizer is None or not output or not req.messages or self._cut_to_rendering(stream, output, text):
            return
        # a template whose reply's tokens ``reply_tokens`` cannot tell: the text's own cut
        stopped = stream.stops is not None and stream.stops.stopped
        eos = self.templater.eos_token_id if self.templater is not None else None
        specials = frozenset(tokenizer.all_special_ids) - {eos}
        cut = reply_in_history(partial(tokenizer.decode, skip_special_tokens=True), partial(encode_text, tokenizer),
                               output, text, stopped or text.endswith("\ufffd"), specials.__contains__)
        if cut is not None and not self.engine.cut_session_turn(req.session_id, req.request_id, stream.prompt_tokens,
                                                                output, *cut):
            log.warning("cache node %s: session %s changed before its turn %s's history could be cut to its reply",
                        self.node_id, req.session_id, req.request_id)

    def _cut_to_rendering(self, stream: _Stream, output: tuple[int, ...], text: str) -> bool:
        """Step thread, at a chat session turn's end: make the history hold the reply its client
        got (``text``) as the tokens a rendering of the conversation holds for it
        (``ChatTemplater.reply_tokens``), so the next turn's prompt is token for token the one
        the same conversation sent without the session gets: the longest prefix of the output
        that is those tokens stays, with its KV; the rest of them replaces the output's other
        tokens (``LLMEngine.cut_session_turn``). That covers every end: a reply cut at a stop
        string, a special stop token (no text), a last character cut in its bytes, an EOS (kept
        as the reply's close), ``max_tokens``, a reply kept as tool calls (the history holds
        the text generated, which the template must render as such: ``continue_session``).
        False when the templater cannot tell the reply's tokens or the prompt does not end as
        it expects (then ``reply_in_history``). Cost: one tokenizer call on the reply's text
        (~1.8 us a token for SmolLM2: 11 ms for 6,000 tokens) and a list comparison.

        Regression (review 30a F2): the history kept the tokens the model generated while a
        request without the session sends the reply's text, which the template tokenizes anew
        (SmolLM2 generates "\\n\\n" as one token, which encodes as two): 2 of 6 two-turn greedy
        conversations had other prompts (107 tokens against 108) and other answers."""
        templater = self.templater
        eos = templater.eos_token_id if templater is not None else None
        rendered = templater.reply_tokens(text, eos is not None and output[-1] == eos) if templater else None
        if rendered is None:
            return False
        lead, tokens = rendered
        cut = rendering_cut(lead, output, tokens)
        if cut is None:
            return True
        req = stream.request
        return self.engine.cut_session_turn(req.session_id, req.request_id, stream.prompt_tokens, output, *cut, lead)

    def _finished_event(self, out: RequestOutput, stream: _Stream) -> Event:
        ttft_ms = (out.ttft_s or 0.0) * 1000.0
        n = out.num_output_tokens
        # from this node's own clock alone (regression: the gateway's arrival time was read on
        # this node's monotonic clock, so tpot_ms was wrong whenever they ran on two machines)
        first = stream.first_token_s
        tpot = (time.monotonic() - first) * 1000.0 / (n - 1) if n > 1 and first is not None else 0.0
        stopped = stream.stops is not None and stream.stops.stopped
        return {
            "type": "finished", "finish_reason": "stop" if stopped else out.finish_reason,
            "prompt_tokens": out.num_prompt_tokens, "completion_tokens": n,
            "cached_tokens": _tiers(out),
            "ttft_ms": ttft_ms, "tpot_ms": tpot, "preempted": out.num_preemptions > 0,
            "prefill_tokens_per_s": self.engine.scheduler.prefill_speed.tokens_per_s,
            "step_s": self.engine.scheduler.step_s.value,
        } | ({"policy_stats": dict(out.policy_stats)} if out.policy_stats else {}) | (
            # a structured request's grammar compile, part of its ttft_ms: the scheduler's pace
            # takes it out (``NodePace.finished``; without it the request is no sample)
            {"grammar_wait_ms": out.grammar_wait_s * 1000.0} if out.grammar_wait_s is not None else {})

    def _flush_events(self) -> None:
        if self.event_sink is None:
            return
        events = self.engine.take_tier_events()
        if events:  # plain tuples: the scheduler need not import the cache node's types
            self.event_sink(self.node_id, [(e.event, e.block_hash, e.tier) for e in events])


def _kept_reply(tool_output: str, text: str, finish_reason: str | None) -> dict[str, str]:
    """A session turn's reply ``text`` as its session keeps it: as the HTTP edge hands it to the
    client (``NodeRequest.tool_output``: read as tool calls, with the ids the client got, in the
    form chat templates take them, ``chat_tools.template_call``; "": the text as content), so the
    next turns render the conversation the client holds. Regression: a reply read as tool calls
    was kept as the model's text (the bare arguments of a named call), another conversation than
    the client's, which it sends the calls' results against."""
    spec = check_tool_output(tool_output)  # (checked when it came off the wire)
    if spec is None:
        return {"role": "assistant", "content": text}
    mode, name, parallel, seed, names = spec  # (an "auto" reply calling an undeclared function: content)
    fields, _ = ToolOutput(mode, name or None, parallel, seed, names).message(text, finish_reason)
    if not fields.get("tool_calls"):
        return {"role": "assistant", "content": text}
    calls = [template_call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in fields["tool_calls"]]
    return {"role": "assistant", "content": fields.get("content") or "",
            "tool_calls": json.dumps(calls, ensure_ascii=False, separators=(",", ":"))}


def reply_in_history(decode: Callable[[list[int]], str], encode: Callable[[str], list[int]], output: tuple[int, ...],
                     text: str, changed: bool, drop: Callable[[int], bool]) -> tuple[int, list[int]] | None:
    """How a session's history must hold a turn's ``output`` for its reply to be ``text`` (what
    its client got): (``keep``, ``tail``), its first ``keep`` tokens and then ``tail``, the rest
    of ``text`` tokenized; None when ``output`` is that already. ``changed``: ``text`` may not
    be ``output``'s decoding (cut at a stop string, or ending in a character cut in its bytes);
    else ``text`` is its decoding and only the trailing tokens ``drop`` names (rendering as
    nothing in the kept reply) go. ``keep`` is the most tokens whose decoding ``text`` starts
    with (a character cut in its bytes at ``text``'s end is no part of it), found in O(log n)
    decodings; ``drop`` tokens before it go as well.
    """
    end = len(output)
    while end and drop(output[end - 1]):
        end -= 1
    if not changed:
        return None if end == len(output) else (end, [])
    whole = text.removesuffix("\ufffd")  # (a character cut in its bytes: tokenized anew)
    lo, hi = 0, end  # the decoding of ``output[:lo]`` starts ``whole``
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if whole.startswith(decode(list(output[:mid]))):
            lo = mid
        else:
            hi = mid - 1
    while lo and drop(output[lo - 1]):
        lo -= 1
    rest = text[len(decode(list(output[:lo]))):]
    if lo == len(output) and not rest:
        return None
    return lo, encode(rest) if rest else []


def rendering_cut(lead: list[int], output: tuple[int, ...], tokens: list[int]) -> tuple[int, list[int]] | None:
    """(``keep``, ``tail``): the history of a turn whose prompt ends with ``lead`` and whose
    ``output`` must read as ``tokens`` (``ChatTemplater.reply_tokens``: ``lead``, then the
    reply's tokens as a rendering holds them) keeps its first ``keep`` output tokens (negative:
    it drops the prompt's last ``-keep``) and then ``tail``; None when it holds them already."""
    have = [*lead, *output]
    same = next((i for i, (a, b) in enumerate(zip(have, tokens)) if a != b), min(len(have), len(tokens)))
    if same == len(have) == len(tokens):
        return None
    return same - len(lead), tokens[same:]


PROMPT_LOGPROBS_PER_EVENT = 512
"""Most prompt tokens' entries one delta event carries (a step computing more sends several):
with 20 alternatives each ~22K msgpack elements and ~230 KB, far within ``EVENT_LIMITS``
whatever ``max_num_batched_tokens`` is."""


def _prompt_logprobs_events(out: RequestOutput) -> list[Event]:
    """``out``'s prompt logprobs (``SamplingParams.prompt_logprobs``) as deltas with no token, of
    at most ``PROMPT_LOGPROBS_PER_EVENT`` entries each."""
    entries = [prompt_logprobs_entry(e.token_id, e.logprob, e.rank, e.top) for e in out.prompt_logprobs]
    return [{"type": "delta", "token_ids": [], "text": "", "prompt_logprobs": entries[i: i + PROMPT_LOGPROBS_PER_EVENT]}
            for i in range(0, len(entries), PROMPT_LOGPROBS_PER_EVENT)]


def _tiers(out: RequestOutput) -> dict[str, int]:
    """Cached prompt tokens per tier (device/host/spill_ram/spill_disk)."""
    return dict(out.num_cached_tokens_by_tier) or {"device": out.num_cached_tokens}
