"""A cache node's requests: starting each opened stream's request in the engine.

On the step thread, between steps, every stream opened since the last step (``_incoming``) has
its request checked and queued in the engine (``_start_incoming``): a session turn whose session
is gone is refused (``SessionGone``, ABORTED), so is one whose session has a turn running, or one
ended whose end is still to be reported (``LLMEngine.check_session_free``;
``cache_node.outputs.SessionBusy``, ABORTED: a conflict the same turn sent later does not
meet), and one that would take its tenant's kept session messages past its budget
(``SessionTextBudget``, RESOURCE_EXHAUSTED), and a structured request whose tenant has
``grammar_compile_queue_per_tenant`` grammar compiles pending here
(``cache_node.outputs.GrammarQueueFull``), or ``grammar_max_active_per_tenant`` structured
requests here (``GrammarActiveFull``, a ``GrammarQueueFull``), RESOURCE_EXHAUSTED: an overload
that passes as they end, not a bad request, sent with its retry hint (the error event's
``retry_after_s``, which the gateway passes on as ``retry-after-ms``, HTTP ``Retry-After``); a turn opening its session first closes a stale
session of its id held here (``_drop_stale_session``); its prompt is the one the
renderer made when its session is unchanged since, else rendered now (``_prompt_of``,
``_prompt``); a request without max_tokens gets what its context leaves (``_sampling``); its
tenant's promises set its share (``_set_tenant_share``). A refusal ends that stream alone with
its error event, never the step loop.

``Requests`` is a part of ``services.cache_node.CacheNode``; it uses the node's ``node_id``,
``engine``, ``config``, ``templater``, ``_streams``, ``_incoming``, ``_session_turns``,
``_session_messages`` and ``_dispatch`` (``Streams``').
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from cache_node.outputs import GrammarQueueFull, SessionBusy, SessionNamespaceChanged
from cache_node.sampling_params import SamplingParams
from cache_node.scheduling import TenantShare
from services import convert
from services.cache_node_streams import _Stream
from services.chat import content_chars, covered_chars
from services.chat_tools import check_session_tool_answers, check_tool_answers, check_wire_tools
from services.node_request import NodeRequest
from services.render_process import RenderFailed

log = logging.getLogger(__name__)


MAX_RERENDERS = 2
"""Times a chat request whose render went stale is queued to render again, off the step thread
(``Requests._prompt_of``); past it the step thread renders it (each needs a turn of its session to
end meanwhile, so a request is stale this often only when sent with its session's other turns)."""


class SessionGone(Exception):
    """A turn routed to its session's node finds no session there (``NodeRequest.continues_session``).

    Regression: a turn admitted before a CloseSession that overtook it on the node was
    computed from its new tokens alone (its answer silently ignored the conversation), and
    the closed session was opened again, holding KV until its TTL."""


class RepeatedOpen(Exception):
    """A submit of the very turn that opened its session here arrives again
    (``NodeRequest.opens_session``; ALREADY_EXISTS): the session it opened stays."""


class SessionTextBudget(Exception):
    """A session turn would take its tenant's kept messages on this node past
    ``NodeConfig.max_session_text_chars_per_tenant`` (RESOURCE_EXHAUSTED)."""


def check_turn_tool_answers(kept: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> None:
    """Each ``tool`` message of a session turn's ``new`` messages answers a call of an earlier
    assistant message, of the session's ``kept`` messages or of the turn, when any of them
    carries ``tool_calls``: the rule of a whole request (``chat_tools.check_tool_answers``) over
    the conversation the client holds. The edges leave a session turn's answers to this (they
    see the turn alone); a first turn (``kept`` empty) is checked as a whole request is.

    Regression (F9): the edges checked a session turn's answers against the turn's own calls
    when it carried any, refusing a turn that added calls and answered an earlier turn's.

    Raises:
        ValueError: worded ``messages.N.tool_call_id: ...`` (``N`` the turn's message).
    """
    if not any(message.get("role") == "tool" for message in new):
        return  # (the kept calls' JSON is not parsed on every turn)
    if any(message.get("tool_calls") for message in kept):
        check_session_tool_answers(kept, new)  # (their ids known before the turn's first message)
    else:  # the turn's calls are the conversation's
        check_tool_answers(new)


class Requests:
    """The requests part of ``CacheNode``: starting opened streams' requests (step thread)."""

    def _start_incoming(self) -> None:
        """Step thread: queue every newly opened stream's request in the engine.

        One whose id the engine still holds for an earlier stream (aborted, its last output not
        delivered yet: the next step's) waits for the next turn. Regression (seen in a loaded
        clean-clone CI, tests/test_gateway_gone.py): a request reusing the id of one aborted
        just before was added to the engine beside it (INVALID_ARGUMENT, duplicate id), or
        after it and the old one's abort output ended the new stream (``finished``, "abort")
        while the new request ran unseen: its client waited for ever."""
        later: list[_Stream] = []
        while self._incoming:
            stream = self._incoming.popleft()
            req = stream.request
            if self._streams.get(req.request_id) is not stream:
                continue  # aborted before it started
            if req.request_id in self._engine_streams:  # an earlier request of this id is not done
                later.append(stream)
                continue
            error = None
            try:
                if req.opens_session:
                    self._drop_stale_session(req)
                if req.continues_session and self.engine.session_history(req.session_id) is None:
                    raise SessionGone("the session ended (closed, expired or its first turn failed) before "
                                      "this turn started; its history is gone: send the turn again to start it anew")
                if req.session_id:  # (before its render: a turn whose end is still to come changes both)
                    self.engine.check_session_free(req.session_id, req.tenant, req.cache_namespace)
                self._check_session_text_budget(req)
                prompt = self._prompt_of(stream)
                if prompt is None:
                    continue  # rendered again, then back here
                sampling = self._sampling(req, len(prompt))
                if (req.max_context_tokens and len(prompt) + sampling.max_tokens > req.max_context_tokens
                        and not self._pool_binds(req)):  # else the engine's pool check names the pool
                    raise ValueError(
                        f"prompt ({len(prompt)}) + max_tokens ({sampling.max_tokens}) exceeds the "
                        f"tenant's max_context_tokens ({req.max_context_tokens})"
                    )
                self._set_tenant_share(req)
                history = stream.history
                if history and prompt[: len(history)] != history:  # the conversation rendered anew
                    self.session_rerenders += 1  # (``ChatTemplater.continue_session``)
                stream.prompt_tokens = len(prompt)
                self.engine.add_request(
                    prompt, sampling, request_id=req.request_id, cache_namespace=req.cache_namespace,
                    session_id=req.session_id or None, tenant=req.tenant, policy=req.policy,
                    prefetch=req.prefetch, priority=req.priority, prefix_tokens=req.prefix_tokens,
                )
                self._engine_streams[req.request_id] = stream
                if req.session_id:
                    self._session_turns[req.request_id] = stream
            except SessionNamespaceChanged as exc:  # the tenant's own session, its namespace moved
                error = {"type": "error", "code": "FAILED_PRECONDITION", "message": str(exc)}
            except PermissionError as exc:
                error = {"type": "error", "code": "PERMISSION_DENIED", "message": str(exc)}
            except (SessionGone, SessionBusy) as exc:
                error = {"type": "error", "code": "ABORTED", "message": str(exc)}
            except RepeatedOpen as exc:
                error = {"type": "error", "code": "ALREADY_EXISTS", "message": str(exc)}
            except GrammarQueueFull as exc:  # (a ValueError)
                error = {"type": "error", "code": "RESOURCE_EXHAUSTED", "message": str(exc),
                         "retry_after_s": exc.retry_after_s}
            except SessionTextBudget as exc:  # (no hint: it stands until a session of its tenant ends)
                error = {"type": "error", "code": "RESOURCE_EXHAUSTED", "message": str(exc)}
            except (ValueError, KeyError, TypeError) as exc:  # bad values, e.g. in ``extra``
                text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                error = {"type": "error", "code": "INVALID_ARGUMENT", "message": text}
            except Exception as exc:  # one request's fault never stops the step loop
                # an unexpected exception's text stays in this node's log, under an error id the
                # tenant gets (review s35 C S1's kind: internal text, which may name other
                # requests, reached a tenant); a RenderFailed's text is this node's own words
                error_id = uuid.uuid4().hex[:12]
                log.exception("cache node %s: request %s could not start (error id %s)", self.node_id,
                              req.request_id, error_id)
                self.engine.abort_request(req.request_id)  # whatever it took, if it got that far
                text = (str(exc) if isinstance(exc, RenderFailed)
                        else f"cache node {self.node_id} failed to start this request (error id {error_id})")
                error = {"type": "error", "code": "INTERNAL", "message": text}
            if error is not None:
                self._dispatch([(stream, error)])
        self._incoming.extendleft(reversed(later))  # first in the next turn, in their order

    def _drop_stale_session(self, req: NodeRequest) -> None:
        """Step thread, between steps: ``req`` opens its session (``NodeRequest.opens_session``:
        the scheduler routed that id nowhere), so a session of its id and tenant held here is
        stale (closed, expired or lost at the scheduler, its close never reaching this node):
        it is closed as a CloseSession would close it (its KV blocks freed, its kept messages'
        budget given back) before ``req`` starts. Its turn still running, and its turns that
        reached this node before ``req`` and have not started, end ABORTED: the scheduler
        routes no turn of that session any more, and its client closed it or was told it is
        lost, so no answer of it is still owed; a refusal of ``req`` would instead lose the
        turn the client sends now, and let the turns sent after it meet the stale history.
        Turns that reached the node after ``req`` are the new session's and stay. Another
        tenant's session of that id is left to the engine's refusal (PERMISSION_DENIED).

        Regression: such a turn was appended to the stale history and answered from a
        conversation the client had closed, with OK.

        Raises:
            RepeatedOpen: ``req`` is the very turn that opened the session held here (a
                repeated submit): the session stays.
        """
        sess = self.engine.sessions.sessions.get(req.session_id)
        if sess is None or sess.tenant != req.tenant:
            return
        if sess.opened_by == req.request_id:
            raise RepeatedOpen("this turn opened its session on this node already: a repeated submit "
                               "does not open it anew")
        freed = self._close_session(req.session_id, before=req.request_id,
                                    why="a later turn opened this session anew: the scheduler no longer routed it "
                                    "here (closed, expired or lost), so its history is gone")
        log.warning("cache node %s: turn %.100s opens session %.100s anew: dropped the stale one held here "
                    "(%d tokens)", self.node_id, req.request_id, req.session_id, freed)

    def _pool_binds(self, req: NodeRequest) -> bool:
        """``req``'s KV policy keeps every token and this node's pool holds fewer tokens than
        its context limit: the pool is its bound, and a request past both is refused naming the
        pool (``LLMEngine._check_fits``), as the gateway refuses it (review 25b R2: a session
        turn past both was told the context, then, trimmed to it, the pool).

        Raises:
            ValueError: ``req.policy`` is no KV policy spec.
        """
        return (self.engine.scheduler.pool_tokens < req.max_context_tokens
                and not (req.policy and convert.policy_compresses(req.policy)))

    def _check_session_text_budget(self, req: NodeRequest) -> None:
        """Refuse a session turn whose messages would take its tenant's kept messages on this
        node (``SessionTexts.tenant_chars``) past ``max_session_text_chars_per_tenant``: their
        text, their tool calls' (ids, names, arguments) and the turn's tools', which the session
        keeps to render its next turns. Regression: tool calls and tools were served in no
        session; counted as content alone they would have let a tenant keep any amount of text.

        Raises:
            SessionTextBudget: they would.
        """
        if not (req.session_id and req.messages):
            return
        budget = self.config.max_session_text_chars_per_tenant
        kept = self._session_messages.tenant_chars.get(req.tenant, 0)
        chars = self._session_messages.added_chars(req.session_id, req.messages, req.tools)  # tool calls, tools too
        if kept + chars > budget:
            raise SessionTextBudget(
                f"this turn's {chars} characters of messages (tools and tool calls included) would take the tenant's sessions on this node past "
                f"max_session_text_chars_per_tenant ({budget}; they keep {kept}): close sessions (CloseSession) "
                "or let idle ones expire")

    def _sampling(self, req: NodeRequest, num_prompt_tokens: int) -> SamplingParams:
        """``req.sampling``; a request without max_tokens (``extra["fill_context"]``) gets what
        the context limit, the model and this node's pool leave after its whole prompt
        (session history included). A prompt that leaves no room gets its ``min_tokens`` (at
        least 1), then is refused for its size, as the gateway does (regression, s39 review r3:
        max_tokens 1 under a min_tokens of 2+ was refused "min_tokens must be an integer in [0,
        max_tokens (1)]", a max_tokens the client never sent); one that leaves less room than
        min_tokens is still refused naming min_tokens."""
        if req.extra.get("fill_context") != "1":
            return req.sampling
        limit = min(req.max_context_tokens or self.engine.max_model_len, self.engine.max_model_len,
                    self.engine.scheduler.pool_tokens)
        room = limit - num_prompt_tokens
        return dataclasses.replace(req.sampling, max_tokens=room if room > 0 else max(1, req.sampling.min_tokens))

    def _set_tenant_share(self, req: NodeRequest) -> None:
        extra = req.extra
        if "slo_class" not in extra:
            return
        quota_blocks = int(extra.get("kv_quota_bytes", 0)) // self.engine.pool.bytes_per_block
        self.engine.scheduler.policy.set_tenant(req.tenant, TenantShare(
            extra["slo_class"], float(extra["ttft_slo_ms"]), float(extra.get("min_tokens_per_s", 0)),
            float(extra.get("weight", 1)), quota_blocks,
        ))

    def _prompt_of(self, stream: _Stream) -> list[int] | None:
        """Step thread: ``stream``'s prompt token ids, as the renderer made them when its
        session is as it was then (its history and messages); None when its session changed
        since (a turn of it ended): it is queued to be rendered again, off this thread. Sets
        ``stream.history`` (the session's history before this turn).

        Regression (review 28a F4): a stale render was redone here, on the step thread: a
        tenant sending a short turn and a 640K-character turn of one session together (the
        short one ending while the long one rendered) had the long one rendered on the step
        thread, which stopped every tenant's streams for 0.25-1.9 s. At most
        ``MAX_RERENDERS`` times a request, then here (review 28l F1: an opening turn whose id
        another tenant's session holds never matched its render, and went round ~8,500 times
        a second, never answered).

        Raises:
            ValueError: what rendering raised (``_prompt``).
        """
        req = stream.request
        history = self.engine.session_history(req.session_id) if req.session_id else None
        stream.history = history
        rendered, stream.rendered = stream.rendered, None
        if rendered is not None and rendered[:2] == (history, len(self._session_messages.get(req.session_id, ()))):
            if isinstance(rendered[2], Exception):
                raise rendered[2]
            return rendered[2]
        if (req.messages and self.templater is not None and stream.rerenders < MAX_RERENDERS
                and self._queue_render(stream)):
            stream.rerenders += 1
            return None
        return self._prompt(req, history)

    def _prompt(self, req: NodeRequest, history: list[int] | None, templater: Any = None) -> list[int]:
        """``req``'s prompt token ids after its session's ``history`` (None: none), its messages
        rendered with its tools (``NodeRequest.tools``), by ``templater`` (None: the node's; the
        renderer thread's is its render child's, ``Streams._render_templater``). A session turn continues its history
        when the template renders the history as its tokens hold it
        (``ChatTemplater.continue_session``), else the whole conversation is rendered anew, as a
        first turn with this turn's tools (counted: ``session_rerenders`` in the node's stats):
        other tools than the history's, or a last reply kept as tool calls that the template
        writes otherwise than the model did. Never a continuation whose tokens differ from the
        whole conversation's rendering.

        A session's messages are kept on the node for its next turns, so its whole text (the
        history's and this turn's) must fit ``room`` tokens as one turn's does, and a turn's
        text must come to the tokens it can stand for (``ChatTemplater.check_tokens_cover``).
        Regression (security review F3): only each turn's text was bounded, so a session of
        turns the tokenizer turns into next to no tokens kept ~112 MB of text on the node.

        Raises:
            ValueError: a chat on a node without a tokenizer, or text that can never fit.
        """
        if req.token_ids:
            return (history or []) + list(req.token_ids)
        templater = templater or self.templater
        if templater is None:
            raise ValueError("this node's model has no tokenizer; send token ids")
        room = min(self.engine.max_model_len, self.engine.scheduler.pool_tokens)
        templater.check_messages_fit(req.messages, room)
        chars = content_chars(req.messages)
        tools = check_wire_tools(req.tools)  # (checked when it came off the wire)
        if history:
            sid = req.session_id
            templater.check_fits(self._session_messages.chars(sid) + chars, room,
                                 "the session's messages (its history's and this turn's)")
            kept = self._session_messages.get(sid, [])
            check_turn_tool_answers(kept, req.messages)
            prompt, continued = templater.continue_session(
                kept, history, req.messages, tools, same_tools=self._session_messages.tools(sid) == req.tools,
                tool_reply=self._session_messages.tool_reply(sid))
            if not continued:  # the whole conversation rendered anew: this turn's text against all its tokens
                added = len(prompt)  # (the kept text was checked when it came; a template may leave the
                # model's tool calls out of the rendering, so the history's text need not come to tokens)
            else:
                added = len(prompt) - len(history)  # this turn's tokens (an EOS closing the history at most over)
        else:
            if req.session_id:  # (the edge leaves a session turn's answers to its node)
                check_turn_tool_answers((), req.messages)
            prompt = templater.first_turn(req.messages, tools)
            added = len(prompt)
        if req.session_id:  # its messages are kept (their tool calls bounded by the text budget)
            templater.check_tokens_cover(covered_chars(req.messages), added)
        return prompt
