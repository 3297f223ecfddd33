"""Chat prompts as token ids: first turns and session continuations.

A session's history lives as token ids in the cache node (so its KV is reused exactly).
A next turn must append only the new messages' tokens, rendered the way the model's chat
template would render the whole conversation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.chat_tools import template_message, tool_calls_chars

if TYPE_CHECKING:  # an annotation alone: importing transformers costs ~1 s
    from transformers import PreTrainedTokenizerBase

Messages = Sequence[dict[str, Any]]

DROPPED_CHARS_SLACK = 64
"""Characters a turn's text may hold beyond what its tokens can stand for
(``ChatTemplater.check_tokens_cover``): a few control characters the tokenizer drops."""


class TemplateRefusal(ValueError):
    """The model's chat template refused a request's messages (its words, cut to 512
    characters): the request's fault, INVALID_ARGUMENT / HTTP 400 naming ``messages``.
    Regression: the template's ``jinja2.TemplateError`` was no ValueError, so the gateway
    answered UNKNOWN / HTTP 500 and a session turn the node renders ended INTERNAL."""


def content_chars(messages: Messages) -> int:
    """Characters of the text of chat ``messages``: their content, and their ``name``,
    ``tool_call_id`` and ``tool_calls`` (ids, names, arguments: ``chat_tools.tool_calls_chars``)
    where given (text the chat template may render, and that a session keeps: every character
    bound counts them, review 25b N3; a session's kept tool calls counted nowhere let a tenant
    keep any amount of text on a node)."""
    return sum(len(m.get("content") or "") + len(m.get("name") or "") + len(m.get("tool_call_id") or "")
               + tool_calls_chars(m.get("tool_calls")) for m in messages)


def covered_chars(messages: Messages) -> int:
    """Characters of chat ``messages`` that ``ChatTemplater.check_tokens_cover`` asks to come to
    tokens: ``content_chars`` without their ``tool_calls``, which a template may leave out of
    the rendering (SmolLM2's does) or render only in part (no ids); the calls' text is bounded
    by ``content_chars`` in every character bound and the session text budget instead.
    Regression (review 29i F1): a session turn whose messages held an assistant call with
    5,412 characters of arguments was refused "5530 characters came to only 25 tokens ...
    control characters: remove them", while the same body without ``session_id`` was served."""
    return sum(len(m.get("content") or "") + len(m.get("name") or "") + len(m.get("tool_call_id") or "")
               for m in messages)


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``, without special tokens added unless ``add_special_tokens`` (a
    BOS, where the tokenizer's post-processor adds one: vLLM's ``/tokenize`` of a prompt):
    ``tokenizer(text).input_ids``.

    A fast tokenizer's Rust backend is called through ``encode_batch_fast``, which releases
    the GIL while it works and builds no character offsets. Regression (diff review): through
    ``tokenizer(text)`` the offsets and encodings of a 600K-character prompt were built while
    holding the GIL, so tokenizing it on a worker thread still stalled the gateway's event
    loop (every tenant's streams) for 95-175 ms per call; this way 20-30 ms, and faster.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


class ChatTemplater:
    """Renders chat messages with the tokenizer's chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; send token ids instead")
        self.tokenizer = tokenizer
        self.eos_token = tokenizer.eos_token or ""
        self.eos_token_id = tokenizer.eos_token_id

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """Most characters of text one token can stand for: its longest vocabulary piece (a
        byte-level piece has a character per byte, so at least as many as its text). None
        when the tokenizer normalizes text first (a piece may then stand for more input).
        Control characters the vocabulary has no piece for are dropped by the tokenizer:
        they count as characters against ``check_fits`` without adding tokens."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        return max(len(piece) for piece in self.tokenizer.get_vocab())

    def check_fits(self, num_chars: int, max_tokens: int, what: str = "prompt") -> None:
        """Refuse ``num_chars`` characters of text that can never come to at most
        ``max_tokens`` tokens, before anything renders or tokenizes it.

        Regression (security review): the bounds on a prompt's tokens were checked only after
        its text (up to 1 Mi characters, ~3.6 s of tokenizing) was rendered and tokenized, on
        the gateway's event loop and, for a session turn, on the cache node's step thread:
        each such refused request stalled every other tenant's streams for seconds.

        Raises:
            ValueError: more than ``max_tokens * max_token_chars`` characters.
        """
        most = self.max_token_chars
        if most is not None and num_chars > max_tokens * most:
            raise ValueError(f"{what}: {num_chars} characters can never fit in {max_tokens} tokens "
                             f"(a token of this model stands for at most {most} characters)")

    def check_messages_fit(self, messages: Messages, max_tokens: int) -> None:
        """``check_fits`` for the content of chat ``messages``.

        Raises:
            ValueError: their content can never come to at most ``max_tokens`` tokens.
        """
        self.check_fits(content_chars(messages), max_tokens, "messages")

    def check_tokens_cover(self, num_chars: int, num_tokens: int, what: str = "messages") -> None:
        """Refuse ``num_chars`` characters of text that tokenized to only ``num_tokens`` tokens:
        more than those tokens' pieces can hold (``max_token_chars`` each) plus
        ``DROPPED_CHARS_SLACK``, so most of the text is characters the tokenizer drops. Exact for
        a byte-level vocabulary (a piece has a character per byte of the text it stands for);
        no check without one (``max_token_chars`` None).

        Regression (security review F3): SmolLM2's vocabulary encodes U+0004, U+0006, U+0013,
        U+0014, U+0016 and U+001D to no token, so a session turn of 331,776 of them passed every
        bound, added ~12 tokens to the history and all its text to what the cache node keeps for
        the session: ~112 MB per session, a node's memory per tenant without bound.

        Raises:
            ValueError: ``num_chars`` exceeds ``num_tokens * max_token_chars + DROPPED_CHARS_SLACK``.
        """
        most = self.max_token_chars
        if most is not None and num_chars > num_tokens * most + DROPPED_CHARS_SLACK:
            raise ValueError(f"{what}: {num_chars} characters came to only {num_tokens} tokens; a token "
                             f"of this model stands for at most {most} characters, the rest are characters "
                             "the tokenizer drops (control characters): remove them")

    @functools.cached_property
    def conversation_overhead(self) -> int:
        """Tokens ``estimate_tokens`` counts that a later turn of a session may not add: those
        of a conversation of one empty user message (a default system prompt, the message's
        header, the generation prompt; a bound from above)."""
        return len(self.first_turn([{"role": "user", "content": ""}]))

    def render(self, messages: Messages, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """``messages`` as the template writes them; ``tools`` (OpenAI's shape) go to it too (a
        template that does not use them leaves them out).

        Raises:
            TemplateRefusal: the template refused the messages (its ``raise_exception``, e.g.
                "Conversation roles must alternate", or a runtime error on their values).
        """
        import jinja2  # (transformers' own dependency, imported by it already)

        try:
            return self.tokenizer.apply_chat_template(
                [template_message(m) for m in messages], tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except jinja2.TemplateSyntaxError:  # the deployment's template, not the request: the node's fault
            raise
        except jinja2.TemplateError as exc:
            raise TemplateRefusal(f"messages: the model's chat template refused them: {str(exc)[:512]}") from exc

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    @functools.cached_property
    def reply_lead(self) -> tuple[str, list[int]] | None:
        """The text the template writes between the generation prompt's last added token
        (``<|im_start|>`` for ChatML) and the assistant's reply (``"assistant\\n"``), and its
        token ids: the tokenizer splits a rendering at added tokens, so the reply's tokens in a
        rendered conversation are those of this text and the reply together, less this text's
        (``reply_tokens``). None when the template refuses a one-message conversation or its
        generation prompt holds no added token (the reply's tokens then depend on the whole
        conversation before it)."""
        try:
            text = self.render([{"role": "user", "content": "x"}])
        except TemplateRefusal:
            return None
        added = [t.content for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values() if t.content]
        end = max((text.rfind(a) + len(a) for a in added if a in text), default=-1)
        if end < 0:
            return None
        return text[end:], self.encode(text[end:])

    def reply_tokens(self, text: str, eos: bool) -> tuple[list[int], list[int]] | None:
        """(``lead``, ``tokens``): the token ids a rendering of the conversation holds for an
        assistant reply of ``text`` (closed by EOS: ``eos``), as a request sending that
        conversation without its session gets them, after the ``lead`` ids of ``reply_lead``
        (which its prompt ends with when the template renders it as this templater's own
        probe does: the engine checks, ``SessionTable.cut_turn``); ``tokens`` starts with them
        unless the reply's first characters tokenize together with the lead's. None without a
        ``reply_lead``. One tokenizer call on the reply's text (~1.8 us a token, SmolLM2).
        """
        lead = self.reply_lead
        if lead is None:
            return None
        tokens = self.encode(lead[0] + text)
        if eos and self.eos_token_id is not None:
            tokens.append(self.eos_token_id)
        return lead[1], tokens

    def estimate_tokens(self, messages: Messages) -> int:
        """Prompt tokens ``messages`` add, for admission's TTFT estimate when the node renders
        them (a session turn: the gateway does not hold the history). Exact for a session's
        first turn; for a later turn it overstates by what the template adds to a conversation
        once (a default system prompt, if the template has one). A later turn's messages alone
        may be what the template refuses (e.g. one that must start with a system message):
        then their text's tokens plus ``conversation_overhead``, and the node, rendering them
        after their history, decides."""
        try:
            return len(self.first_turn(messages))
        except TemplateRefusal:
            return len(self.encode("\n".join(m.get("content") or "" for m in messages))) + self.conversation_overhead

    def first_turn(self, messages: Messages, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a whole conversation (with ``tools``), ending with the assistant
        generation prompt."""
        return self.encode(self.render(messages, tools=tools))

    def continuation(
        self, history_messages: Messages, history_tokens: list[int], new_messages: Messages
    ) -> list[int]:
        """Prompt for the next turn: ``history_tokens`` + the new messages' tokens
        (``continue_session`` without tools)."""
        return self.continue_session(history_messages, history_tokens, new_messages)[0]

    def continue_session(
        self, history_messages: Messages, history_tokens: list[int], new_messages: Messages,
        tools: list[dict[str, Any]] | None = None, same_tools: bool = True, tool_reply: str | None = None,
    ) -> tuple[list[int], bool]:
        """Prompt for the next turn, and whether it continues the history: ``history_tokens`` +
        the new messages' tokens, rendered with ``tools`` as the template renders the whole
        conversation; else (False) the whole conversation rendered as a first turn
        (``first_turn(history + new, tools)``: exact, its history's KV past the common prefix
        computed again).

        ``history_tokens`` ends with the assistant's last reply (EOS when it stopped, otherwise
        EOS is appended as the template would close the message), held as the tokens a
        rendering of the conversation holds for the reply's text, not as the model generated
        them (the cache node cuts each turn's history so: ``Streams._cut_to_rendering``,
        ``reply_tokens``; review 30a F2: SmolLM2's one-token "\\n\\n" is two tokens in the
        rendering, so a continuation was a token shorter than the conversation's prompt). It
        continues only when the template renders the history as its text holds it: the whole
        conversation's rendering starts with the history's, the history was rendered with the same tools
        (``same_tools``: templates put tools in the system prompt, so other tools are another
        prefix), and a last reply kept as tool calls (``tool_reply``: the text the model
        generated, whose tokens the history holds) renders as that very text (a template
        writes calls its own way: ``<tool_call>{...}</tool_call>`` where a named choice
        generated the bare arguments); so does a last reply kept as its text (a template whose
        generation prompt is not how it opens an assistant message, e.g. one without the
        newline it writes after the role). Regression: a continuation of such a history was the
        generated tokens followed by text rendered after the template's form of the call (or of
        the message), a prompt no rendering of the conversation gives; one more rendering (the
        history before its last reply) per turn checks it.
        """
        whole = list(history_messages) + list(new_messages)
        if not same_tools:
            return self.first_turn(whole, tools), False
        prev = self.render(history_messages, add_generation_prompt=False, tools=tools)
        full = self.render(whole, tools=tools)
        last = history_messages[-1] if history_messages else {}
        reply = tool_reply if tool_reply is not None else (
            last.get("content") if last.get("role") == "assistant" and not last.get("tool_calls") else None)
        if not full.startswith(prev) or (reply is not None and not self._renders_as(
                history_messages, prev, reply, tools, strict=tool_reply is not None)):
            return self.first_turn(whole, tools), False
        glue = prev[prev.rfind(self.eos_token) + len(self.eos_token) :] if self.eos_token else ""
        closed = history_tokens if history_tokens[-1:] == [self.eos_token_id] else history_tokens + [self.eos_token_id]
        return closed + self.encode(glue + full[len(prev) :]), True

    def _renders_as(self, history_messages: Messages, prev: str, reply: str, tools: list[dict[str, Any]] | None,
                    strict: bool) -> bool:
        """The template renders the last of ``history_messages`` (the assistant's reply; ``prev``
        the history's rendering) as ``reply`` closed by EOS: the rendering before it with the
        generation prompt, then ``reply``, then EOS and what follows it. Without an EOS token to
        find the reply's end by: ``not strict`` (a reply kept as its text continues as before)."""
        if not self.eos_token:
            return not strict
        before = self.render(history_messages[:-1], add_generation_prompt=True, tools=tools)
        return prev[: prev.rfind(self.eos_token)] == before + reply

CHARS_PER_TOKEN = 4
"""Fallback for ``estimate_message_tokens`` without a template (English text averages ~4)."""


def estimate_message_tokens(templater: ChatTemplater | None, messages: Messages) -> int:
    """``templater.estimate_tokens(messages)``, or their characters / ``CHARS_PER_TOKEN`` when
    there is no template to render them with."""
    if templater is not None:
        return templater.estimate_tokens(messages)
    return sum(len(m.get("content", "")) for m in messages) // CHARS_PER_TOKEN + 1
